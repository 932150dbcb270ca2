"""The warm parent compiles vLLM's compiled helpers once (``engine/compiled.py``), and the ranks it forks compile
none of them again: dynamo's own count of compiled frames in every rank after a TP=2 start that asks for
log-probabilities (vLLM's logprob ranks) and shards the vocabulary (the shard masks) equals what the rank inherited.
Without the warm-up, or with a guard the warm-up misses (grad mode, thread count, the input's dtype or dispatch keys),
each rank compiles both (measured: 4 frames a rank)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any


def _compiled_frames(worker: Any) -> int:
    from torch._dynamo.utils import counters

    return int(counters["frames"]["ok"])


def _start(workdir: str) -> tuple[Any, int, list[Any]]:
    from torch._dynamo.utils import counters

    from pytest_enginecheck.targets.vllm.checkpoints.tiny import tiny_checkpoint
    from pytest_enginecheck.targets.vllm.engine import warm
    from pytest_enginecheck.targets.vllm.engine.drive import EngineWork
    from pytest_enginecheck.targets.vllm.engine.run import run_engine

    os.environ["VLLM_PLUGINS"] = "clean"
    checkpoint = tiny_checkpoint("LlamaForCausalLM", workdir)
    inherited = int(counters["frames"]["ok"])
    run = run_engine(str(checkpoint), 2, work=EngineWork(worker_rpc=_compiled_frames))
    assert run.logprobs, "the start asked for no log-probabilities"
    return warm.COMPILED, inherited, run.captures


def test_ranks_forked_from_the_warm_parent_compile_none_of_vllms_helpers(in_child: Any, tmp_path: Path) -> None:
    compiled, inherited, frames = in_child(_start, str(tmp_path))
    assert compiled == ["logprob_ranks", "vocab_shard_masks"]
    assert inherited >= len(compiled)  # the warm parent's frames, which every fork below it counts from
    assert frames == [inherited, inherited]
