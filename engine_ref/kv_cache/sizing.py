"""KV cache sizing: what a rank needs, how many blocks fit, and the largest max_model_len that fits.

The one place this arithmetic lives; EngineCore, the Worker, the memory estimate and the plugin's
budget check all call ``size_kv_cache``, so an estimate and a measurement agree by construction:

    budget     = int(capacity * gpu_memory_utilization)                  on each rank
    available  = budget - weights - buffers - lora - activation_peak     on each rank
    num_blocks = max(0, min(available)) // bytes_per_block               the most constrained rank decides
    one request of max_model_len holds cdiv(max_model_len, block_size) blocks

The activation peak is that of the profile run, a batch of max_num_batched_tokens tokens, which by
default follows max_model_len (``default_max_num_batched_tokens``); ``lora`` is the preallocated LoRA
adapter slots (max_loras x max_lora_rank), 0 without LoRA.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from engine_ref.errors import KVCacheTooSmallError, MemoryShortfall
from engine_ref.utils import cdiv, format_bytes

#: The fewest tokens the engine batches per step (and profiles) when max_num_batched_tokens is not set.
DEFAULT_MAX_NUM_BATCHED_TOKENS = 2048


def default_max_num_batched_tokens(max_model_len: int) -> int:
    """max_num_batched_tokens when none is given: a full-length prompt, and at least DEFAULT_MAX_NUM_BATCHED_TOKENS."""
    return max(max_model_len, DEFAULT_MAX_NUM_BATCHED_TOKENS)


class RankMemory(Protocol):
    """One rank's memory before its KV cache (``MemoryUsage`` is one)."""

    capacity: int
    weights: int
    buffers: int
    lora: int
    activation_peak: int


@dataclass(frozen=True)
class KVCacheSizing:
    """The KV cache of an engine: the blocks every rank allocates, and what one max_model_len request needs."""

    block_size: int
    bytes_per_block: int  # one block id, over every layer of one rank
    max_model_len: int
    gpu_memory_utilization: float
    budget_bytes: tuple[int, ...]  # per rank: capacity * gpu_memory_utilization
    available_bytes: tuple[int, ...]  # per rank: the budget less weights, buffers, LoRA slots, activation peak
    num_blocks: int

    @property
    def rank(self) -> int:
        """The most constrained rank: the one with the least memory left for the KV cache."""
        return self.available_bytes.index(min(self.available_bytes))

    @property
    def request_bytes(self) -> int:
        """KV cache bytes of one request of max_model_len tokens, on one rank."""
        return cdiv(self.max_model_len, self.block_size) * self.bytes_per_block

    @property
    def largest_max_model_len(self) -> int:
        """The longest request num_blocks can hold."""
        return self.num_blocks * self.block_size

    @property
    def fits(self) -> bool:
        """Whether one request of max_model_len fits in num_blocks."""
        return self.largest_max_model_len >= self.max_model_len

    @property
    def slack_tokens(self) -> int:
        """Tokens to spare beyond one max_model_len request (negative: it does not fit).

        Unlike num_blocks, the blocks are not clamped at zero when no memory is left, so the slack
        keeps falling as max_model_len (and with it the activation peak) grows.
        """
        return min(self.available_bytes) // self.bytes_per_block * self.block_size - self.max_model_len

    def needs(self, rank: int, memory: RankMemory) -> MemoryShortfall:
        """What ``rank`` needs to serve one request: its weights, buffers, LoRA slots, activation peak, one
        request's KV."""
        return MemoryShortfall(rank=rank, weights=memory.weights, buffers=memory.buffers,
                               activation_peak=memory.activation_peak, kv_cache=self.request_bytes,
                               capacity=memory.capacity, lora=memory.lora)


def size_kv_cache(memory: Sequence[RankMemory], *, gpu_memory_utilization: float, bytes_per_block: int,
                  block_size: int, max_model_len: int, num_blocks_override: int | None = None) -> KVCacheSizing:
    """Size the KV cache of the ranks whose memory (after the profile run) is ``memory``."""
    if not memory or bytes_per_block < 1 or block_size < 1:
        raise ValueError(f"KV cache sizing needs at least one rank and positive sizes, got {len(memory)} ranks, "
                         f"bytes_per_block={bytes_per_block}, block_size={block_size}")
    budget = tuple(int(m.capacity * gpu_memory_utilization) for m in memory)
    available = tuple(b - m.weights - m.buffers - m.lora - m.activation_peak
                      for b, m in zip(budget, memory, strict=True))
    num_blocks = max(0, min(available)) // bytes_per_block if num_blocks_override is None else num_blocks_override
    return KVCacheSizing(block_size, bytes_per_block, max_model_len, gpu_memory_utilization, budget, available,
                         num_blocks)


def check_enough_kv_cache_memory(sizing: KVCacheSizing, memory: Sequence[RankMemory]) -> None:
    """Raise KVCacheTooSmallError, with the most constrained rank's needs, unless one request fits."""
    if sizing.fits:
        return
    rank = sizing.rank
    needs = sizing.needs(rank, memory[rank])
    lora, lora_after, lower_lora = "", "", ""
    if needs.lora:
        lora = f", the LoRA adapter slots ({format_bytes(needs.lora)})"
        lora_after = f" after the LoRA adapter slots ({format_bytes(needs.lora)})"
        lower_lora = " lower max_loras or max_lora_rank (the LoRA slots: --max-loras, --max-lora-rank),"
    if sizing.num_blocks == 0 and sizing.available_bytes[rank] <= 0:
        raise KVCacheTooSmallError(
            f"No memory is left for the KV cache on rank {rank}: weights ({format_bytes(needs.weights)}), "
            f"buffers ({format_bytes(needs.buffers)}){lora} and the profile run's activation peak "
            f"({format_bytes(needs.activation_peak)}) exceed {sizing.gpu_memory_utilization} x "
            f"{format_bytes(needs.capacity)} of device memory. Raise the device memory or "
            f"gpu_memory_utilization,{lower_lora} lower max_num_batched_tokens (the profile run's size), or raise "
            f"tensor_parallel_size.", needs)
    largest = sizing.largest_max_model_len
    raise KVCacheTooSmallError(
        f"To serve at least one request with max_model_len {sizing.max_model_len}, "
        f"{format_bytes(sizing.request_bytes)} of KV cache is needed, larger than the available "
        f"{format_bytes(max(0, sizing.available_bytes[rank]))} ({sizing.num_blocks} blocks of {sizing.block_size} "
        f"tokens){lora_after}; the largest max_model_len that fits is {largest}. Raise gpu_memory_utilization or the "
        f"device memory,{lower_lora} lower max_model_len (to at most {largest}), or raise tensor_parallel_size.",
        needs)
