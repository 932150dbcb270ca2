"""The KV cache: the block pool's bookkeeping, the sizing arithmetic, and sizing errors at engine start."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from engine_ref import LLM
from engine_ref.errors import KVCacheTooSmallError
from engine_ref.kv_cache.block_pool import BlockPool
from engine_ref.kv_cache.sizing import (
    DEFAULT_MAX_NUM_BATCHED_TOKENS,
    KVCacheSizing,
    check_enough_kv_cache_memory,
    default_max_num_batched_tokens,
    size_kv_cache,
)
from engine_ref.kv_cache.spec import FullAttentionSpec, bytes_per_block
from engine_ref.memory.accounting import MemoryUsage
from engine_ref.utils import format_bytes

# The tiny Llama: 2 layers, 2 KV heads of 64 / 4 = 16 dims, float32.
LLAMA_LAYERS, LLAMA_KV_HEADS, LLAMA_HEAD_DIM = 2, 2, 16


def nano_vllm_block_bytes(layers: int, block_size: int, kv_heads: int, head_dim: int, itemsize: int) -> int:
    """nano-vllm's formula, written out independently of the engine."""
    return 2 * layers * block_size * kv_heads * head_dim * itemsize


# -- BlockPool -------------------------------------------------------------------------------------


class BlockPoolMachine(RuleBasedStateMachine):
    """Random allocate / free sequences against a model of who holds how many blocks."""

    def __init__(self) -> None:
        super().__init__()
        self.pool: BlockPool | None = None
        self.tokens: dict[int, int] = {}  # owner -> largest token count it asked for

    @precondition(lambda self: self.pool is None)
    @rule(num_blocks=st.integers(1, 12), block_size=st.integers(1, 8))
    def create(self, num_blocks: int, block_size: int) -> None:
        self.pool = BlockPool(num_blocks, block_size)

    @precondition(lambda self: self.pool is not None)
    @rule(owner=st.integers(0, 5), num_tokens=st.integers(0, 60))
    def allocate(self, owner: int, num_tokens: int) -> None:
        pool = self.pool
        held = len(pool.block_table(owner))
        needed = max(0, -(-num_tokens // pool.block_size) - held)
        before = (pool.num_free_blocks, {o: list(pool.block_table(o)) for o in self.tokens})
        if needed > pool.num_free_blocks:
            assert not pool.can_allocate(owner, num_tokens)
            with pytest.raises(MemoryError, match=f"{needed} KV cache blocks needed"):
                pool.allocate(owner, num_tokens)
            assert (pool.num_free_blocks, {o: list(pool.block_table(o)) for o in self.tokens}) == before
            assert len(pool.block_table(owner)) == held
            return
        assert pool.can_allocate(owner, num_tokens)
        old_table = list(pool.block_table(owner))
        table = pool.allocate(owner, num_tokens)
        assert table[: len(old_table)] == old_table  # growing never moves a held block
        assert len(table) == held + needed
        assert len(table) * pool.block_size >= num_tokens
        self.tokens[owner] = max(self.tokens.get(owner, 0), num_tokens)

    @precondition(lambda self: self.pool is not None)
    @rule(owner=st.integers(0, 6))
    def free(self, owner: int) -> None:
        pool = self.pool
        held = len(pool.block_table(owner))
        free_before = pool.num_free_blocks
        pool.free(owner)
        assert pool.num_free_blocks == free_before + held
        assert pool.block_table(owner) == []
        self.tokens.pop(owner, None)

    @invariant()
    def blocks_are_conserved_and_never_shared(self) -> None:
        if self.pool is None:
            return
        held = [b for owner in self.tokens for b in self.pool.block_table(owner)]
        free = list(self.pool._free)
        assert len(held) == len(set(held)), "a block is held by two owners"
        assert not set(held) & set(free), "a held block is also free"
        assert sorted(held + free) == list(range(self.pool.num_blocks))
        assert self.pool.num_free_blocks + len(held) == self.pool.num_blocks

    @invariant()
    def tables_are_as_small_as_possible(self) -> None:
        if self.pool is None:
            return
        for owner, tokens in self.tokens.items():
            assert len(self.pool.block_table(owner)) == -(-tokens // self.pool.block_size)


BlockPoolMachine.TestCase.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)
TestBlockPool = BlockPoolMachine.TestCase


def test_block_pool_refuses_an_empty_pool() -> None:
    with pytest.raises(ValueError, match="num_blocks=0"):
        BlockPool(0, 16)


def test_block_pool_hands_out_every_block_exactly_once() -> None:
    pool = BlockPool(4, 16)
    tables = [pool.allocate(owner, 16) for owner in range(4)]
    assert sorted(b for t in tables for b in t) == [0, 1, 2, 3]
    with pytest.raises(MemoryError):
        pool.allocate(99, 1)
    pool.free(2)
    assert pool.allocate(99, 1) == tables[2]


# -- sizing arithmetic -----------------------------------------------------------------------------


specs_strategy = st.builds(
    lambda layers, block_size, kv_heads, head_dim, itemsize: {
        f"model.layers.{i}.self_attn.attn": FullAttentionSpec(block_size, kv_heads, head_dim, itemsize)
        for i in range(layers)
    },
    st.integers(1, 8), st.sampled_from([1, 8, 16, 32]), st.integers(1, 8), st.sampled_from([16, 64, 128]),
    st.sampled_from([1, 2, 4]),
)


def one_rank(available: int) -> list[MemoryUsage]:
    """One rank that, at gpu_memory_utilization 1.0, has ``available`` bytes left for the KV cache."""
    return [MemoryUsage(capacity=2**21 + available, weights=60, buffers=40, activation_peak=2**21 - 100)]


def sized(specs: dict[str, FullAttentionSpec], available: int, max_model_len: int = 1,
          num_blocks_override: int | None = None) -> tuple[KVCacheSizing, list[MemoryUsage]]:
    memory = one_rank(available)
    sizing = size_kv_cache(memory, gpu_memory_utilization=1.0, bytes_per_block=bytes_per_block(specs),
                           block_size=next(iter(specs.values())).block_size, max_model_len=max_model_len,
                           num_blocks_override=num_blocks_override)
    return sizing, memory


@given(specs_strategy, st.integers(-(2**20), 2**34))
def test_num_blocks_matches_the_nano_vllm_formula(specs: dict[str, FullAttentionSpec], available: int) -> None:
    spec = next(iter(specs.values()))
    block_bytes = nano_vllm_block_bytes(len(specs), spec.block_size, spec.num_kv_heads, spec.head_size,
                                        spec.dtype_bytes)
    assert bytes_per_block(specs) == block_bytes
    sizing, _ = sized(specs, available)
    assert sizing.available_bytes == (available,)
    num_blocks = sizing.num_blocks
    assert num_blocks >= 0
    assert num_blocks * block_bytes <= max(0, available) < (num_blocks + 1) * block_bytes


@settings(max_examples=200)
@given(specs_strategy, st.lists(st.tuples(st.integers(1, 2**34), st.integers(0, 2**33), st.integers(0, 2**20),
                                          st.integers(0, 2**33)), min_size=1, max_size=4),
       st.sampled_from([0.5, 0.9, 1.0]), st.integers(1, 2**20))
def test_size_kv_cache_properties(specs: dict[str, FullAttentionSpec], ranks: list[tuple[int, int, int, int]],
                                  utilization: float, max_model_len: int) -> None:
    """Blocks fill the least memory any rank has left, and the largest max_model_len fits where one block more
    would not; what a rank needs is what the sizing leaves it."""
    memory = [MemoryUsage(capacity=c, weights=w, buffers=b, activation_peak=p) for c, w, b, p in ranks]
    block_size = next(iter(specs.values())).block_size
    block_bytes = bytes_per_block(specs)
    sizing = size_kv_cache(memory, gpu_memory_utilization=utilization, bytes_per_block=block_bytes,
                           block_size=block_size, max_model_len=max_model_len)
    left = [int(m.capacity * utilization) - m.weights - m.buffers - m.activation_peak for m in memory]
    assert list(sizing.available_bytes) == left
    assert sizing.rank == left.index(min(left))
    available = max(0, min(left))
    assert sizing.num_blocks * block_bytes <= available < (sizing.num_blocks + 1) * block_bytes
    largest = sizing.largest_max_model_len
    assert largest == sizing.num_blocks * block_size
    assert sizing.fits == (max_model_len <= largest)
    assert sizing.slack_tokens >= 0 if sizing.fits else sizing.slack_tokens < 0
    # the largest max_model_len fits in the blocks available; one token (so one block) more does not
    if largest:
        at_largest = size_kv_cache(memory, gpu_memory_utilization=utilization, bytes_per_block=block_bytes,
                                   block_size=block_size, max_model_len=largest)
        assert at_largest.fits and at_largest.request_bytes <= available
    beyond = size_kv_cache(memory, gpu_memory_utilization=utilization, bytes_per_block=block_bytes,
                           block_size=block_size, max_model_len=largest + 1)
    assert not beyond.fits and beyond.request_bytes == (sizing.num_blocks + 1) * block_bytes > available
    needs = [sizing.needs(rank, m) for rank, m in enumerate(memory)]
    for m, n in zip(memory, needs, strict=True):
        assert n.kv_cache == sizing.request_bytes == -(-max_model_len // block_size) * block_bytes
        assert n.total == m.weights + m.buffers + m.activation_peak + sizing.request_bytes
    # it fits exactly when what every rank needs is within its budget
    assert sizing.fits == all(n.total <= budget for n, budget in zip(needs, sizing.budget_bytes, strict=True))


def test_default_max_num_batched_tokens() -> None:
    assert default_max_num_batched_tokens(64) == DEFAULT_MAX_NUM_BATCHED_TOKENS == 2048
    assert default_max_num_batched_tokens(4096) == 4096


@settings(max_examples=100)
@given(specs_strategy, st.integers(0, 500), st.integers(1, 5000))
def test_kv_cache_check_and_its_suggested_length(specs: dict[str, FullAttentionSpec], num_blocks: int,
                                                 max_model_len: int) -> None:
    """Passes iff one max_model_len request fits; otherwise the suggested length does fit."""
    block_size = next(iter(specs.values())).block_size
    available = num_blocks * bytes_per_block(specs)
    sizing, memory = sized(specs, available, max_model_len)
    assert sizing.num_blocks == num_blocks
    if num_blocks * block_size >= max_model_len:
        check_enough_kv_cache_memory(sizing, memory)
        return
    with pytest.raises(KVCacheTooSmallError) as info:
        check_enough_kv_cache_memory(sizing, memory)
    message = str(info.value)
    largest = num_blocks * block_size
    needed = -(-max_model_len // block_size) * bytes_per_block(specs)
    if num_blocks == 0:  # nothing left: the error names the categories instead
        assert "No memory is left for the KV cache on rank 0" in message
    else:
        assert f"max_model_len {max_model_len}," in message
        assert f"the largest max_model_len that fits is {largest}." in message
        assert f"{format_bytes(needed)} of KV cache is needed" in message
        assert f"available {format_bytes(available)}" in message
    assert info.value.shortfall == sizing.needs(0, memory[0])
    assert info.value.shortfall.kv_cache == needed
    if largest:
        check_enough_kv_cache_memory(sized(specs, available, largest)[0], memory)


def test_override_blocks_without_memory_left_still_say_how_many_fit() -> None:
    specs = {"attn": FullAttentionSpec(16, 2, 16, 4)}
    sizing, memory = sized(specs, -5, max_model_len=64, num_blocks_override=3)
    assert sizing.num_blocks == 3
    with pytest.raises(KVCacheTooSmallError, match="the largest max_model_len that fits is 48"):
        check_enough_kv_cache_memory(sizing, memory)


# -- through a real engine -------------------------------------------------------------------------


def start_llm(model: Path, **kwargs: Any) -> LLM:
    settings_ = {"device_memory": "64MiB", "max_model_len": 256, "max_num_batched_tokens": 256, **kwargs}
    return LLM(str(model), **settings_)


@pytest.mark.parametrize(("dtype", "itemsize"), [("float32", 4), ("bfloat16", 2)])
def test_engine_kv_cache_bytes_match_the_formula(dtype: str, itemsize: int, llama: Path) -> None:
    with start_llm(llama, dtype=dtype, max_model_len=64, max_num_batched_tokens=64) as llm:
        report = llm.startup_report
        specs = llm.engine.executor.get_kv_cache_specs()[0]
        block_bytes = nano_vllm_block_bytes(LLAMA_LAYERS, 16, LLAMA_KV_HEADS, LLAMA_HEAD_DIM, itemsize)
        memory = report.workers[0].memory
    assert len(specs) == LLAMA_LAYERS
    assert bytes_per_block(specs) == block_bytes
    assert memory.kv_cache == report.num_gpu_blocks * block_bytes
    budget = int(memory.capacity * 0.9) - memory.weights - memory.buffers - memory.activation_peak
    assert report.num_gpu_blocks == budget // block_bytes
    assert report.kv_cache.num_blocks == report.num_gpu_blocks and report.kv_cache.bytes_per_block == block_bytes


def test_num_gpu_blocks_override(llama: Path) -> None:
    with start_llm(llama, num_gpu_blocks_override=17) as llm:
        report = llm.startup_report
        assert report.num_gpu_blocks == 17
        assert llm.engine.scheduler.block_pool.num_blocks == 17
        block_bytes = nano_vllm_block_bytes(LLAMA_LAYERS, 16, LLAMA_KV_HEADS, LLAMA_HEAD_DIM, 4)
        assert report.workers[0].memory.kv_cache == 17 * block_bytes
        assert len(llm.generate(prompt_token_ids=[[1, 2, 3]], max_tokens=3, ignore_eos=True)[0]) == 3


def test_num_gpu_blocks_override_too_small_for_max_model_len(llama: Path) -> None:
    with pytest.raises(KVCacheTooSmallError, match="the largest max_model_len that fits is 48"):
        start_llm(llama, num_gpu_blocks_override=3)


def test_kv_cache_too_small_names_the_largest_length_that_fits(llama: Path) -> None:
    """Size the device so that exactly 5 blocks fit, then start again at the length the error suggests."""
    with start_llm(llama) as probe:
        memory = probe.startup_report.workers[0].memory
    block_bytes = nano_vllm_block_bytes(LLAMA_LAYERS, 16, LLAMA_KV_HEADS, LLAMA_HEAD_DIM, 4)
    available = 5 * block_bytes + block_bytes // 2
    device_memory = -(-(memory.weights + memory.buffers + memory.activation_peak + available) * 10 // 9)  # 0.9
    with pytest.raises(KVCacheTooSmallError) as info:
        start_llm(llama, device_memory=device_memory)
    message = str(info.value)
    assert "max_model_len 256," in message
    assert f"{format_bytes(16 * block_bytes)} of KV cache is needed" in message
    assert "larger than the available " in message and "(5 blocks of 16 tokens)" in message
    assert "the largest max_model_len that fits is 80." in message
    with start_llm(llama, device_memory=device_memory, max_model_len=80) as llm:
        assert llm.startup_report.num_gpu_blocks >= 5
        assert llm.startup_report.max_model_len == 80


def test_no_memory_left_for_the_kv_cache_names_rank_and_categories(llama: Path) -> None:
    """Weights plus the profile run's activations exceed 0.9 x 1 MiB before any KV block."""
    with pytest.raises(KVCacheTooSmallError) as info:
        start_llm(llama, device_memory="1MiB")
    message = str(info.value)
    assert "No memory is left for the KV cache on rank 0" in message
    assert re.search(r"weights \(\d+\.\d\d KiB\), buffers \([\d.]+ (B|KiB)\) and the profile run's activation "
                     r"peak \(\d+\.\d\d KiB\)", message), message
    assert "0.9 x 1.00 MiB" in message
    assert "lower max_num_batched_tokens" in message
