"""vLLM target: starting vLLM's engine on CPU ranks the way vLLM does (spawned processes) vs from the
warm parent (one forked rank running the engine core in it at TP=1, forked external_launcher ranks at TP>1),
side by side.

    python benchmarks/vllm_startup.py [--architecture LlamaForCausalLM] [--tp 1 2] [--repeat 1]

Each start is one check child (a fork of this process once it imported vLLM, as the plugin's warm
parent does), timed from the fork to the engine being shut down; the tokens must be equal across
modes and TP sizes. Targets (issue 12, 2 cores): TP=1 <= 10 s, TP=2 <= 15 s per architecture, warm.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
from typing import Any


def _start(ckpt: str, tp: int, mode: str) -> dict[str, Any]:
    from pytest_enginecheck.targets.vllm.engine.run import run_engine

    run = run_engine(ckpt, tp, mode)
    return {"tokens": run.tokens, "seconds": run.seconds}


def _checkpoint(architecture: str, workdir: str) -> str:
    from pytest_enginecheck.targets.vllm.checkpoints.tiny import tiny_checkpoint

    return str(tiny_checkpoint(architecture, workdir))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--architecture", default="LlamaForCausalLM")
    parser.add_argument("--tp", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--repeat", type=int, default=1)
    args = parser.parse_args()
    workdir = tempfile.mkdtemp(prefix="enginecheck-bench-")
    os.environ.setdefault("VLLM_CACHE_ROOT", os.path.join(workdir, "vllm-cache"))
    os.environ["ENGINE_REF_WORKER_MULTIPROC_METHOD"] = "fork"  # this process is the warm parent
    try:
        from engine_ref.isolation import run_isolated

        print(f"load: {os.getloadavg()}")
        ckpt = run_isolated(_checkpoint, args.architecture, workdir, timeout=600)
        t = time.perf_counter()
        import vllm.entrypoints.llm  # noqa: F401 - what the warm parent preloads

        print(f"warm parent: imported vLLM's LLM in {time.perf_counter() - t:.1f} s (once per session)")
        tokens: dict[tuple[str, int], Any] = {}
        for tp in args.tp:
            for mode in ("spawn", "warm"):
                for _ in range(args.repeat):
                    t = time.perf_counter()
                    result = run_isolated(_start, ckpt, tp, mode, timeout=600)
                    wall = time.perf_counter() - t
                    tokens[mode, tp] = result["tokens"]
                    inner = ", ".join(f"{k} {v:.1f}" for k, v in result["seconds"].items())
                    print(f"{args.architecture} tp={tp} {mode:5}: {wall:6.1f} s wall per check ({inner})")
        same = len({repr(v) for v in tokens.values()}) == 1
        print(f"greedy tokens equal across modes and TP sizes: {same}")
        print(f"load: {os.getloadavg()}")
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
