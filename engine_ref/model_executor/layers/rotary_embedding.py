"""Rotary position embedding (neox style: rotate halves), with Llama 3 frequency scaling."""

from __future__ import annotations

import json
import math
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

import torch
from torch import nn

from engine_ref.errors import ConfigError

SUPPORTED_ROPE_TYPES = ("default", "llama3")
LLAMA3_SCALING_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
# transformers' ``default_theta`` of each bundled model type, where it is not 10000: the base when
# config.json names none. tests/test_models_hf.py proves it equals transformers' own.
DEFAULT_ROPE_THETA = 10000.0
DEFAULT_ROPE_THETAS = {"mixtral": 1000000.0}


def get_rope_parameters(config: Mapping[str, Any]) -> dict[str, Any]:
    """config.json's rotary settings as transformers 5 standardises them into ``rope_parameters``.

    Older files spell them ``rope_theta`` and ``rope_scaling`` (whose ``type`` is now ``rope_type``);
    ``rope_scaling`` wins over ``rope_parameters``, as in transformers.
    """
    params = dict(config.get("rope_scaling") or config.get("rope_parameters") or {})
    if any(isinstance(value, Mapping) for value in params.values()):
        raise ConfigError(
            f"rope parameters per layer type ({', '.join(params)}) are not supported; give config.json one "
            f"rope_parameters dict."
        )
    params.setdefault("rope_theta", config.get(
        "rope_theta", DEFAULT_ROPE_THETAS.get(config.get("model_type", ""), DEFAULT_ROPE_THETA)))
    if "partial_rotary_factor" in config:
        params.setdefault("partial_rotary_factor", config["partial_rotary_factor"])
    params.setdefault("rope_type", params.get("type", "default"))
    rope_type = params["rope_type"]
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ConfigError(
            f"rope scaling type {rope_type!r} is not supported; supported: {', '.join(SUPPORTED_ROPE_TYPES)}."
        )
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise ConfigError(
            f"partial_rotary_factor={params['partial_rotary_factor']!r} is not supported; only a rotary "
            f"embedding over the whole head (1.0) is."
        )
    if rope_type == "llama3":
        if "original_max_position_embeddings" in config:
            params["original_max_position_embeddings"] = config["original_max_position_embeddings"]
        else:
            params.setdefault("original_max_position_embeddings", config.get("max_position_embeddings"))
        missing = [key for key in LLAMA3_SCALING_KEYS if params.get(key) is None]
        if missing:
            raise ConfigError(f"rope_type 'llama3' needs {', '.join(missing)} in config.json's rope_parameters.")
    return params


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: Mapping[str, Any]) -> torch.Tensor:
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
    """Applies rotary embeddings to flattened q and k (``[tokens, heads * head_size]``).

    ``rope_parameters`` is the standardised dict of ``get_rope_parameters``.
    """

    inv_freq: torch.Tensor

    def __init__(self, head_size: int, rope_parameters: Mapping[str, Any]) -> None:
        super().__init__()
        self.head_size = head_size
        base = float(rope_parameters["rope_theta"])
        # computed on the CPU whatever device the model is built on, as Hugging Face does: the same float32 values
        # everywhere, and on the meta device no Python reference kernels (their first call imports torch._dynamo)
        exponents = torch.arange(0, head_size, 2, dtype=torch.int64, device="cpu").float() / head_size
        inv_freq = 1.0 / (base ** exponents)
        if rope_parameters["rope_type"] == "llama3":
            inv_freq = _llama3_inv_freq(inv_freq, rope_parameters)
        self.register_buffer("inv_freq", inv_freq.to(torch.get_default_device()), persistent=False)

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


_shared_ropes: ContextVar[dict[tuple[int, str], RotaryEmbedding] | None] = ContextVar("_shared_ropes", default=None)


@contextmanager
def shared_rope_scope() -> Iterator[None]:
    """While a model is built: ``get_rope`` returns one shared instance per configuration.

    vLLM's ``get_rope`` caches per process; here the cache lives for one model build (nested scopes
    join the outer one), so a model estimated on the meta device or under a fake-tensor mode never
    shares a table with a real one built in the same process.
    """
    if _shared_ropes.get() is not None:
        yield
        return
    token = _shared_ropes.set({})
    try:
        yield
    finally:
        _shared_ropes.reset(token)


def get_rope(head_size: int, config: Mapping[str, Any]) -> RotaryEmbedding:
    """The rotary embedding a config.json asks for; inside ``shared_rope_scope`` one per configuration,
    so every layer shares one table, allocated (and counted) once."""
    params = get_rope_parameters(config)
    shared = _shared_ropes.get()
    if shared is None:
        return RotaryEmbedding(head_size, params)
    key = (head_size, json.dumps(params, sort_keys=True))
    if key not in shared:
        shared[key] = RotaryEmbedding(head_size, params)
    return shared[key]
