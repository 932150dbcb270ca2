"""Llava: a CLIP vision tower and a projector in front of a Llama language model.

Image placeholder tokens (``image_token_index``) in the prompt are replaced by the projected
features of the image's patches, one token per patch, in order.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import ClassVar

import torch
from torch import nn

from engine_ref.config import HFConfig
from engine_ref.errors import ConfigError, InputError
from engine_ref.model_executor.layers.activation import get_act_fn
from engine_ref.model_executor.layers.linear import ColumnParallelLinear, RowParallelLinear
from engine_ref.model_executor.model_loader.weight_utils import (
    CheckpointTensor,
    WeightsMapper,
    load_mapped_weights,
)
from engine_ref.model_executor.models.clip import CLIPVisionModel
from engine_ref.model_executor.models.interfaces import SupportsMultiModal
from engine_ref.model_executor.models.llama import LlamaForCausalLM


class LlavaMultiModalProjector(nn.Module):
    def __init__(self, vision_hidden: int, text_hidden: int, act: str, bias: bool) -> None:
        super().__init__()
        self.linear_1 = ColumnParallelLinear(vision_hidden, text_hidden, bias=bias)
        self.act = get_act_fn(act)
        self.linear_2 = RowParallelLinear(text_hidden, text_hidden, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(self.act(self.linear_1(x)))


class LlavaForConditionalGeneration(nn.Module, SupportsMultiModal):
    """Equal to transformers' LlavaForConditionalGeneration (one feature layer, 'default' or 'full')."""

    reference_config: ClassVar[str] = "llava-1.5-7b-hf.json"
    example_config: ClassVar[dict] = {
        "architectures": ["LlavaForConditionalGeneration"], "model_type": "llava", "torch_dtype": "float32",
        "image_token_index": 255, "projector_hidden_act": "gelu", "vision_feature_layer": -2,
        "vision_feature_select_strategy": "default", "multimodal_projector_bias": True,
        "tie_word_embeddings": False,
        "text_config": {
            "model_type": "llama", "vocab_size": 256, "hidden_size": 64, "intermediate_size": 128,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
            "max_position_embeddings": 512, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "hidden_act": "silu",
            "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2,
        },
        "vision_config": {
            "model_type": "clip_vision_model", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
            "num_attention_heads": 4, "image_size": 32, "patch_size": 8, "num_channels": 3,
            "hidden_act": "quick_gelu", "layer_norm_eps": 1e-5, "projection_dim": 32,
        },
    }

    def __init__(self, config: HFConfig) -> None:
        super().__init__()
        vision, text = config.vision_config, config.text_config
        feature_layer = config.get("vision_feature_layer", -2)
        if not isinstance(feature_layer, int):
            raise ConfigError(f"vision_feature_layer={feature_layer!r}: only a single layer index is supported.")
        self.select_strategy = config.get("vision_feature_select_strategy", "default")
        if self.select_strategy not in ("default", "full"):
            raise ConfigError(
                f"vision_feature_select_strategy={self.select_strategy!r} is unknown; use 'default' or 'full'."
            )
        num_layers = feature_layer if feature_layer >= 0 else vision.num_hidden_layers + feature_layer + 1
        self.image_token_index = config.image_token_index
        self.vision_tower = CLIPVisionModel(vision, num_layers)
        self.multi_modal_projector = LlavaMultiModalProjector(
            vision.hidden_size, text.hidden_size, config.get("projector_hidden_act", "gelu"),
            bias=config.get("multimodal_projector_bias", True))
        self.language_model = LlamaForCausalLM(text)
        unused_layers = tuple(f"vision_tower.vision_model.encoder.layers.{i}."
                              for i in range(num_layers, vision.num_hidden_layers))
        self.weights_mapper = WeightsMapper(
            mapping=self.language_model.weights_mapper.mapping,
            skip=(*self.language_model.weights_mapper.skip, "vision_tower.vision_model.post_layernorm.",
                  "vision_tower.vision_model.embeddings.position_ids", *unused_layers))

    @property
    def tokens_per_image(self) -> int:
        return self.vision_tower.num_patches + (self.select_strategy == "full")

    def dummy_image_inputs(self) -> tuple[list[int], torch.Tensor]:
        """One image's placeholder tokens and a blank image: the profile run's multimodal input."""
        size = self.vision_tower.vision_model.embeddings.image_size
        dtype = self.vision_tower.vision_model.embeddings.patch_embedding.weight.dtype
        return [self.image_token_index] * self.tokens_per_image, torch.zeros(1, 3, size, size, dtype=dtype)

    def get_image_features(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """``[images, 3, H, W]`` -> ``[images * tokens_per_image, text hidden]``."""
        features = self.vision_tower(pixel_values)
        if self.select_strategy == "default":
            features = features[:, 1:]
        return self.multi_modal_projector(features).flatten(0, 1)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                pixel_values: torch.Tensor | None = None) -> torch.Tensor:
        embeds = self.language_model.get_input_embeddings(input_ids)
        is_image = input_ids == self.image_token_index
        num_placeholders = int(is_image.sum())
        if pixel_values is not None or num_placeholders:
            num_images = 0 if pixel_values is None else pixel_values.shape[0]
            if num_placeholders != num_images * self.tokens_per_image:
                raise InputError(
                    f"the prompts hold {num_placeholders} image tokens ({self.image_token_index}) but "
                    f"{num_images} image(s) were given, which need {num_images * self.tokens_per_image}; "
                    f"put {self.tokens_per_image} image tokens in a prompt per image."
                )
            if pixel_values is not None and num_images:
                features = self.get_image_features(pixel_values.to(embeds.dtype))
                embeds = embeds.masked_scatter(is_image.unsqueeze(-1), features)
        return self.language_model(input_ids, positions, inputs_embeds=embeds)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.language_model.compute_logits(hidden_states)

    def load_weights(self, weights: Iterable[tuple[str, CheckpointTensor]]) -> set[str]:
        return load_mapped_weights(self, ((hub_vision_tower_name(name), tensor) for name, tensor in weights),
                                   self.weights_mapper)


def hub_vision_tower_name(name: str) -> str:
    """The Hub's name of a vision tower tensor: transformers 5 saves the CLIP tower without its
    ``vision_model.`` level (``vision_tower.embeddings...``), the Hub's files have it."""
    if name.startswith("vision_tower.") and not name.startswith("vision_tower.vision_model."):
        return "vision_tower.vision_model." + name.removeprefix("vision_tower.")
    return name
