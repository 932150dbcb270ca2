"""A CLIP vision encoder (the tower in front of Llava's language model), sharded like the language model."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine_ref.config import HFConfig
from engine_ref.errors import InputError
from engine_ref.model_executor.layers.activation import get_act_fn
from engine_ref.model_executor.layers.linear import ColumnParallelLinear, QKVParallelLinear, RowParallelLinear


class CLIPVisionEmbeddings(nn.Module):
    """Patch embedding (a strided conv) plus a class token, plus learned position embeddings."""

    def __init__(self, config: HFConfig) -> None:
        super().__init__()
        self.image_size, self.patch_size = config.image_size, config.patch_size
        self.num_positions = (self.image_size // self.patch_size) ** 2 + 1
        self.class_embedding = nn.Parameter(torch.empty(config.hidden_size), requires_grad=False)
        self.patch_embedding = nn.Conv2d(config.get("num_channels", 3), config.hidden_size,
                                         kernel_size=self.patch_size, stride=self.patch_size, bias=False)
        # given its (loaded) weight: nn.Embedding's own init draws on the meta device through Python reference
        # kernels, whose first call imports torch._dynamo (~1 s)
        self.position_embedding = nn.Embedding(self.num_positions, config.hidden_size,
                                               _weight=torch.empty(self.num_positions, config.hidden_size))

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        if pixel_values.shape[-2:] != (self.image_size, self.image_size):
            raise InputError(
                f"image of size {tuple(pixel_values.shape[-2:])} given, but the vision tower takes "
                f"{self.image_size}x{self.image_size}; resize the image."
            )
        patches = self.patch_embedding(pixel_values.to(self.patch_embedding.weight.dtype))
        patches = patches.flatten(2).transpose(1, 2)
        cls = self.class_embedding.expand(pixel_values.shape[0], 1, -1)
        return torch.cat([cls, patches], dim=1) + self.position_embedding.weight


class CLIPAttention(nn.Module):
    """Bidirectional multi-head self-attention over an image's patches; heads split over ranks."""

    def __init__(self, config: HFConfig) -> None:
        super().__init__()
        hidden = config.hidden_size
        self.head_dim = hidden // config.num_attention_heads
        heads = config.num_attention_heads
        self.qkv_proj = QKVParallelLinear(hidden, self.head_dim, heads, heads, bias=True)
        self.out_proj = RowParallelLinear(hidden, hidden, bias=True)
        self.num_heads = self.qkv_proj.num_heads

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, _ = x.shape
        q, k, v = (t.view(batch, length, self.num_heads, self.head_dim).transpose(1, 2)
                   for t in self.qkv_proj(x).chunk(3, dim=-1))
        out = F.scaled_dot_product_attention(q, k, v)
        return self.out_proj(out.transpose(1, 2).reshape(batch, length, -1))


class CLIPEncoderLayer(nn.Module):
    def __init__(self, config: HFConfig) -> None:
        super().__init__()
        eps = config.get("layer_norm_eps", 1e-5)
        self.layer_norm1 = nn.LayerNorm(config.hidden_size, eps=eps)
        self.self_attn = CLIPAttention(config)
        self.layer_norm2 = nn.LayerNorm(config.hidden_size, eps=eps)
        self.mlp = nn.Sequential()
        self.mlp.add_module("fc1", ColumnParallelLinear(config.hidden_size, config.intermediate_size))
        self.mlp.add_module("act", get_act_fn(config.get("hidden_act", "quick_gelu")))
        self.mlp.add_module("fc2", RowParallelLinear(config.intermediate_size, config.hidden_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x))
        return x + self.mlp(self.layer_norm2(x))


class CLIPEncoder(nn.Module):
    def __init__(self, config: HFConfig, num_layers: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(CLIPEncoderLayer(config) for _ in range(num_layers))


class CLIPVisionTransformer(nn.Module):
    """Embeddings, pre-norm, and the first ``num_layers`` encoder layers (no post-norm: unused by Llava)."""

    def __init__(self, config: HFConfig, num_layers: int) -> None:
        super().__init__()
        self.embeddings = CLIPVisionEmbeddings(config)
        self.pre_layrnorm = nn.LayerNorm(config.hidden_size, eps=config.get("layer_norm_eps", 1e-5))
        self.encoder = CLIPEncoder(config, num_layers)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        x = self.pre_layrnorm(self.embeddings(pixel_values))
        for layer in self.encoder.layers:
            x = layer(x)
        return x


class CLIPVisionModel(nn.Module):
    """Checkpoint names ``vision_model.*``, as in transformers' CLIPVisionModel."""

    def __init__(self, config: HFConfig, num_layers: int) -> None:
        super().__init__()
        self.vision_model = CLIPVisionTransformer(config, num_layers)

    @property
    def num_patches(self) -> int:
        return self.vision_model.embeddings.num_positions - 1

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        return self.vision_model(pixel_values)
