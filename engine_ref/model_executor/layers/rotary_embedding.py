"""Rotary position embedding (neox style: rotate halves), with Llama 3 frequency scaling."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from engine_ref.errors import ConfigError

SUPPORTED_ROPE_TYPES = ("default", "llama3")


def get_rope_parameters(config: Any) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, scaling) from config.json, in either the legacy or the transformers 5 layout."""
    params = config.get("rope_parameters") or {}
    theta = params.get("rope_theta", config.get("rope_theta", 10000.0))
    scaling = config.get("rope_scaling") or (params if params.get("rope_type", "default") != "default" else None)
    if scaling is not None:
        rope_type = scaling.get("rope_type", scaling.get("type", "default"))
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise ConfigError(
                f"rope scaling type {rope_type!r} is not supported; supported: {', '.join(SUPPORTED_ROPE_TYPES)}."
            )
        if rope_type == "default":
            scaling = None
    return float(theta), scaling


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict[str, Any]) -> torch.Tensor:
    """Llama 3's long-context scaling: slow low frequencies, keep high ones, blend in between."""
    factor = scaling["factor"]
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_len = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(is_medium, blended, scaled)


class RotaryEmbedding(nn.Module):
    """Applies rotary embeddings to flattened q and k (``[tokens, heads * head_size]``)."""

    def __init__(self, head_size: int, base: float, scaling: dict[str, Any] | None = None) -> None:
        super().__init__()
        self.head_size = head_size
        inv_freq = 1.0 / (base ** (torch.arange(0, head_size, 2, dtype=torch.int64).float() / head_size))
        if scaling is not None:
            inv_freq = _llama3_inv_freq(inv_freq, scaling)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float().unsqueeze(-1) * self.inv_freq.unsqueeze(0)
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos().to(q.dtype).unsqueeze(1), emb.sin().to(q.dtype).unsqueeze(1)
        return self._rotate(q, cos, sin), self._rotate(k, cos, sin)

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.view(shape[0], -1, self.head_size)
        x1, x2 = x.chunk(2, dim=-1)
        rotated = torch.cat((-x2, x1), dim=-1)
        return (x * cos + rotated * sin).reshape(shape)


def get_rope(head_size: int, config: Any) -> RotaryEmbedding:
    """The rotary embedding a config.json asks for."""
    base, scaling = get_rope_parameters(config)
    return RotaryEmbedding(head_size, base, scaling)
