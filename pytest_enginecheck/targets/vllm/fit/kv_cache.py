"""A rank's KV cache at full size, by vLLM's own functions (``vllm.v1.core.kv_cache_planning``,
``kv_cache_utils`` before 0.34).

From each layer's KV-cache spec (``rank_model``): vLLM's grouping of the layers (``get_kv_cache_groups``: one group
for uniform full attention; sliding-window, MLA and mamba layers grouped as the engine groups them), the bytes of
one block of every group (``_pool_bytes_per_block``: what vLLM divides the available memory by), and for an amount
of available memory the blocks vLLM allocates (``get_kv_cache_config_from_groups``), the tokens it logs
(``get_kv_cache_capacity``), whether one request of max_model_len fits (``check_enough_kv_cache_memory``, with the
null block the pool holds back), and the largest max_model_len that would (``estimate_max_model_len``, searched up to
the model's own maximum).
"""

from __future__ import annotations

import collections
from dataclasses import dataclass
from typing import Any

# Where vLLM keeps its KV-cache sizing: kv_cache_planning since 0.34 (its KV-cache config builder's default path),
# kv_cache_utils before (and for get_kv_cache_capacity still)
HOMES = ("vllm.v1.core.kv_cache_planning", "vllm.v1.core.kv_cache_utils")
NEEDED = "the fit prediction sizes the KV cache with"


def candidates(name: str) -> tuple[tuple[str, str], ...]:
    """Where ``name`` of vLLM's KV-cache sizing may live, newest home first (probe.find's candidates)."""
    return tuple((home, name) for home in HOMES)


def _find(name: str) -> Any:
    from pytest_enginecheck.targets.vllm.probe import find

    return find(candidates(name), NEEDED)


@dataclass(frozen=True)
class KvLayout:
    """A rank's KV cache layout: vLLM's groups, the bytes of one block of all of them, one request's bytes."""

    groups: list[Any]
    bytes_per_block: int
    block_size: int
    one_request_bytes: int  # every layer's max_memory_usage_bytes at max_model_len
    layers: int
    description: str

    @property
    def bytes_per_token(self) -> int:
        """One block of every group over the block size: what one more token of cache costs the rank."""
        return self.bytes_per_block // self.block_size if self.groups else 0


@dataclass(frozen=True)
class KvFit:
    """What vLLM makes of ``available`` bytes for the KV cache on one rank."""

    num_blocks: int
    kv_cache_bytes: int
    tokens: int
    max_concurrency: float
    fits: bool  # one request of max_model_len fits (vLLM's check_enough_kv_cache_memory passes)
    max_model_len_that_fits: int  # 0: not even one token


def kv_layout(vllm_config: Any, specs: dict[str, Any]) -> KvLayout:
    """vLLM's grouping of ``specs`` and the bytes one block of every group takes."""
    groups = _find("get_kv_cache_groups")(vllm_config, dict(specs))
    per_block = int(_find("_pool_bytes_per_block")(vllm_config, groups)) if groups else 0
    one_request = int(_find("max_memory_usage_bytes")(vllm_config, specs.values()))
    return KvLayout(groups, per_block, vllm_config.cache_config.block_size, one_request, len(specs), describe(specs))


def describe(specs: dict[str, Any]) -> str:
    """The specs by kind, e.g. "80 x FullAttentionSpec(num_kv_heads=2, head_size=128, bfloat16)"."""
    if not specs:
        return "no layer holds a KV cache"
    fields = ("num_kv_heads", "head_size", "sliding_window", "shapes")
    kinds = collections.Counter(
        f"{type(s).__name__}(" + ", ".join([f"{f}={getattr(s, f)}" for f in fields if getattr(s, f, None)]
                                           + [str(getattr(s, "dtype", "")).removeprefix("torch.")]) + ")"
        for s in specs.values())
    return ", ".join(f"{n} x {kind}" for kind, n in kinds.items())


def kv_fit(vllm_config: Any, specs: dict[str, Any], layout: KvLayout, available: int, max_len_bound: int) -> KvFit:
    """vLLM's KV cache on a rank with ``available`` bytes for it: blocks, tokens, whether max_model_len fits, and
    the largest max_model_len up to ``max_len_bound`` that would."""
    if not layout.groups:  # attention-free: vLLM allocates one null block and any length fits
        return KvFit(1, 0, 0, 0.0, available >= 0, max_len_bound if available >= 0 else 0)
    if available < layout.bytes_per_block:
        return KvFit(0, 0, 0, 0.0, False, 0)
    config = _find("get_kv_cache_config_from_groups")(vllm_config, layout.groups, available)
    tokens, concurrency = _find("get_kv_cache_capacity")(vllm_config, config)
    usable = available - layout.bytes_per_block  # the null block BlockPool holds back
    fits = layout.one_request_bytes <= usable
    model_config = vllm_config.model_config
    configured = model_config.max_model_len
    model_config.max_model_len = max_len_bound
    try:
        longest = int(_find("estimate_max_model_len")(vllm_config, specs, usable))
    finally:
        model_config.max_model_len = configured
    return KvFit(config.num_blocks, config.num_blocks * layout.bytes_per_block, int(tokens), float(concurrency),
                 fits, longest)
