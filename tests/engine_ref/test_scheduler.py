"""The scheduler: requests that do not all fit at once are queued, served, and give their blocks back."""

from __future__ import annotations

from pathlib import Path

from engine_ref import LLM


def test_prompts_of_different_lengths_are_all_served_and_blocks_return(llama: Path) -> None:
    """With room for only two requests at a time, every prompt still completes; the pool ends full."""
    prompts = [list(range(1, n + 1)) for n in (3, 17, 30, 9, 40)]
    with LLM(str(llama), device_memory="64MiB", max_model_len=64, max_num_batched_tokens=64,
             num_gpu_blocks_override=5) as llm:
        pool = llm.engine.scheduler.block_pool
        outputs = llm.generate(prompt_token_ids=prompts, max_tokens=8, ignore_eos=True)
        assert pool.num_free_blocks == pool.num_blocks == 5
        assert not llm.engine.has_unfinished_requests()
        alone = [llm.generate(prompt_token_ids=[p], max_tokens=8, ignore_eos=True)[0] for p in prompts]
    assert [len(o) for o in outputs] == [8] * len(prompts)
    assert outputs == alone
