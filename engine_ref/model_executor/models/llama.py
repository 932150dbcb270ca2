"""Llama, equal to transformers' LlamaForCausalLM; the base the other decoder-only models extend.

Extension points: a decoder layer's ``qkv_bias`` / ``qk_norm`` class attributes and ``make_mlp``,
and the causal LM's ``decoder_layer_cls`` and ``make_weights_mapper``.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, ClassVar

import torch
from torch import nn

from engine_ref.config import HFConfig
from engine_ref.model_executor.layers.activation import SiluAndMul, check_gated_silu
from engine_ref.model_executor.layers.attention import Attention
from engine_ref.model_executor.layers.layernorm import RMSNorm
from engine_ref.model_executor.layers.linear import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from engine_ref.model_executor.layers.rotary_embedding import get_rope, shared_rope_scope
from engine_ref.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding
from engine_ref.model_executor.model_loader.weight_utils import (
    CheckpointTensor,
    WeightsMapper,
    load_mapped_weights,
)
from engine_ref.model_executor.models.interfaces import SupportsLoRA, SupportsQuant

if TYPE_CHECKING:
    from engine_ref.model_executor.layers.quantization.base_config import QuantizationConfig

STACKED_PARAMS_MAPPING = (
    (".qkv_proj", ".q_proj", "q"),
    (".qkv_proj", ".k_proj", "k"),
    (".qkv_proj", ".v_proj", "v"),
    (".gate_up_proj", ".gate_proj", 0),
    (".gate_up_proj", ".up_proj", 1),
)


class LlamaMLP(nn.Module):
    """down(silu(gate(x)) * up(x)); gate and up are one column-parallel matmul."""

    def __init__(self, hidden_size: int, intermediate_size: int, hidden_act: str = "silu", bias: bool = False,
                 quant_config: QuantizationConfig | None = None, prefix: str = "") -> None:
        super().__init__()
        check_gated_silu(hidden_act)
        self.gate_up_proj = MergedColumnParallelLinear(hidden_size, [intermediate_size] * 2, bias=bias,
                                                       quant_config=quant_config, prefix=f"{prefix}.gate_up_proj")
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, bias=bias, quant_config=quant_config,
                                           prefix=f"{prefix}.down_proj")
        self.act_fn = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class LlamaAttention(nn.Module):
    """qkv projection, optional per-head q/k RMSNorm, rotary embedding, paged attention, o projection."""

    def __init__(self, config: HFConfig, qkv_bias: bool, o_bias: bool, qk_norm: bool,
                 quant_config: QuantizationConfig | None = None, prefix: str = "") -> None:
        super().__init__()
        hidden_size = config.hidden_size
        total_heads = config.num_attention_heads
        total_kv_heads = config.get("num_key_value_heads") or total_heads
        self.head_dim = config.get("head_dim") or hidden_size // total_heads
        self.qkv_proj = QKVParallelLinear(hidden_size, self.head_dim, total_heads, total_kv_heads, bias=qkv_bias,
                                          quant_config=quant_config, prefix=f"{prefix}.qkv_proj")
        self.o_proj = RowParallelLinear(total_heads * self.head_dim, hidden_size, bias=o_bias,
                                        quant_config=quant_config, prefix=f"{prefix}.o_proj")
        self.q_size, self.kv_size = self.qkv_proj.q_size, self.qkv_proj.kv_size
        if qk_norm:
            self.q_norm = RMSNorm(self.head_dim, eps=config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.qk_norm = qk_norm
        self.rotary_emb = get_rope(self.head_dim, config)
        self.attn = Attention(self.qkv_proj.num_heads, self.head_dim, self.head_dim**-0.5,
                              self.qkv_proj.num_kv_heads)

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv_proj(hidden_states).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        if self.qk_norm:
            q = self.q_norm(q.reshape(-1, self.head_dim)).view(q.shape)
            k = self.k_norm(k.reshape(-1, self.head_dim)).view(k.shape)
        q, k = self.rotary_emb(positions, q, k)
        return self.o_proj(self.attn(q, k, v))


class LlamaDecoderLayer(nn.Module):
    """Pre-norm attention and MLP blocks with residual connections."""

    qkv_bias: ClassVar[bool | None] = None  # None: config.json's attention_bias
    o_bias: ClassVar[bool | None] = None
    qk_norm: ClassVar[bool] = False

    def __init__(self, config: HFConfig, layer_idx: int, quant_config: QuantizationConfig | None = None,
                 prefix: str = "") -> None:
        super().__init__()
        self.quant_config, self.prefix = quant_config, prefix  # read by make_mlp
        bias = config.get("attention_bias", False)
        self.self_attn = LlamaAttention(
            config,
            qkv_bias=bias if self.qkv_bias is None else self.qkv_bias,
            o_bias=bias if self.o_bias is None else self.o_bias,
            qk_norm=self.qk_norm,
            quant_config=quant_config,
            prefix=f"{prefix}.self_attn",
        )
        self.mlp = self.make_mlp(config, layer_idx)
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def make_mlp(self, config: HFConfig, layer_idx: int) -> nn.Module:
        return LlamaMLP(config.hidden_size, config.intermediate_size, config.get("hidden_act", "silu"),
                        bias=config.get("mlp_bias", False), quant_config=self.quant_config, prefix=f"{self.prefix}.mlp")

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor, residual: torch.Tensor | None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual, hidden_states = hidden_states, self.input_layernorm(hidden_states)
        else:
            hidden_states, residual = self.input_layernorm(hidden_states, residual)
        hidden_states = self.self_attn(positions, hidden_states)
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        return self.mlp(hidden_states), residual


class LlamaModel(nn.Module):
    """Embedding, decoder layers, final norm: token ids in, hidden states out."""

    def __init__(self, config: HFConfig, decoder_layer_cls: type[LlamaDecoderLayer],
                 quant_config: QuantizationConfig | None = None, prefix: str = "model") -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        with shared_rope_scope():  # one rotary table for all layers
            self.layers = nn.ModuleList(decoder_layer_cls(config, i, quant_config, f"{prefix}.layers.{i}")
                                        for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        hidden_states = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        residual = None
        for layer in self.layers:
            hidden_states, residual = layer(positions, hidden_states, residual)
        hidden_states, _ = self.norm(hidden_states, residual)
        return hidden_states


class LlamaForCausalLM(nn.Module, SupportsLoRA, SupportsQuant):
    """Llama with its LM head; the contract every engine_ref text model follows."""

    decoder_layer_cls: ClassVar[type[LlamaDecoderLayer]] = LlamaDecoderLayer
    reference_config: ClassVar[str] = "Meta-Llama-3-8B.json"
    example_config: ClassVar[dict] = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "torch_dtype": "float32",
        "vocab_size": 256, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 512,
        "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "hidden_act": "silu", "tie_word_embeddings": False,
        "bos_token_id": 1, "eos_token_id": 2,
    }

    def __init__(self, config: HFConfig, quant_config: QuantizationConfig | None = None) -> None:
        super().__init__()
        self.config = config
        self.tie_word_embeddings = bool(config.get("tie_word_embeddings", False))
        self.model = LlamaModel(config, self.decoder_layer_cls, quant_config)
        if self.tie_word_embeddings:
            self.lm_head = self.model.embed_tokens
        else:
            self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size)
        self.weights_mapper = self.make_weights_mapper(config)

    def make_weights_mapper(self, config: HFConfig) -> WeightsMapper:
        skip = ("rotary_emb.inv_freq",) + (("lm_head.",) if self.tie_word_embeddings else ())
        return WeightsMapper(mapping=STACKED_PARAMS_MAPPING, skip=skip)

    def get_input_embeddings(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(input_ids)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        return self.model(input_ids, positions, inputs_embeds)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.lm_head.compute_logits(hidden_states)

    def load_weights(self, weights: Iterable[tuple[str, CheckpointTensor]]) -> set[str]:
        return load_mapped_weights(self, weights, self.weights_mapper)
