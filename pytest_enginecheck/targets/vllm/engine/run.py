"""vLLM's own engine on CPU ranks, started from the warm process or the way vLLM starts it by default.

- ``warm`` (default): every start forks its ranks from this process, which itself never runs an engine
  (a process that ran vLLM's CPU engine deadlocks the torch ops of a later fork, so a check that starts
  vLLM several times, as the TP diagnosis does, must never run one in-process). TP=1 is one fork running
  vLLM's engine core in-process there (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, the ``uni`` executor); TP=N
  forks N ranks, each an engine of vLLM's ``external_launcher`` executor (vLLM's torchrun-style mode: every
  rank runs the same deterministic scheduler and its own worker, joined by torch.distributed over gloo).
  Nothing re-imports vLLM.
- ``spawn``: vLLM's defaults, an engine-core process and (TP>1) MultiprocExecutor workers, which
  vLLM's CPU platform always starts by spawn (``VLLM_WORKER_MULTIPROC_METHOD=spawn`` is forced in
  ``CpuPlatform.check_and_update_config``), so each re-imports vLLM. Kept for fidelity and the benchmark.

Every start returns the greedy tokens of fixed prompt token ids, the top-``LOGPROBS`` log-probabilities vLLM
computed at every position (each prompt token's and each generated token's), vLLM's per-rank memory figures and
phase timings, and shuts the engine down; a failure is an EngineStartError naming phase and rank. The warm ranks
are waited for under one deadline (``engine_ref.isolation``'s ``AnswerWait``): at the deadline every rank still
running has its Python stacks in the failure and is killed; a rank that died is named by its exit; the ranks'
exit after their answers shares one grace (SHUTDOWN_GRACE_S). What the engine calls of vLLM comes from the probe
(``probe.engine_api``), so a vLLM without it ends in VllmUnavailable before any rank starts.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from typing import Any

from pytest_enginecheck.targets.vllm.engine.drive import SHUTDOWN_GRACE_S, EngineRun, EngineWork, drive
from pytest_enginecheck.targets.vllm.engine.ranks import run_ranks
from pytest_enginecheck.targets.vllm.env import cpu_engine_env
from pytest_enginecheck.targets.vllm.probe import engine_api, model_initializer

START_MODES = ("warm", "spawn")


@contextlib.contextmanager
def _short_tmpdir() -> Iterator[None]:
    """TMPDIR (here and in the processes vLLM spawns) a new directory directly in /tmp for the block, removed after:
    vLLM's engine core binds its ZeroMQ IPC sockets in TMPDIR, and a check's private TMPDIR nests past the 107-byte
    limit of a socket's path."""
    path = tempfile.mkdtemp(prefix="vllm-", dir="/tmp" if os.path.isdir("/tmp") else None)
    before = os.environ.get("TMPDIR")
    os.environ["TMPDIR"] = tempfile.tempdir = path
    try:
        yield
    finally:
        tempfile.tempdir = None
        if before is None:
            os.environ.pop("TMPDIR", None)
        else:
            os.environ["TMPDIR"] = before
        shutil.rmtree(path, ignore_errors=True)


def run_engine(ckpt: str, tp: int, mode: str = "warm", timeout: float = 300.0,
               engine_args: dict[str, Any] | None = None, work: EngineWork | None = None) -> EngineRun:
    """Start vLLM on ``ckpt`` at ``tp`` ranks (see the module docstring), generate, measure, stop.

    ``work``: what the start does besides generating (``EngineWork``: a LoRA adapter's requests, a worker RPC, or
    only a hooked prefill, as the TP diagnosis runs). ``engine_args``: more of ``LLM``'s arguments (the dtype,
    LoRA's ``enable_lora``)."""
    if mode not in START_MODES:
        raise ValueError(f"mode={mode!r}: use one of {', '.join(START_MODES)}")
    engine_api()  # a vLLM without what the engine needs ends here (VllmUnavailable, a skip), not inside a rank
    if work is None or work.hooked_prefill is None:
        model_initializer()  # what rank_memory sizes the weights with
    os.environ.update(cpu_engine_env(tp))
    start = time.perf_counter()
    if mode == "spawn":
        # collective_rpc ships rank_memory (a function) to the engine-core process: vLLM's opt-in for pickling it.
        os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
        os.environ["VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS"] = str(int(SHUTDOWN_GRACE_S))  # drive.shutdown
        with _short_tmpdir():
            run = drive(ckpt, tp, mode, 0, dict(engine_args or {}), work or EngineWork())
    else:
        run = run_ranks(ckpt, tp, timeout, dict(engine_args or {}), work or EngineWork())
    run.seconds["total"] = time.perf_counter() - start
    return run
