"""startup on vLLM: vLLM starts, serves the fixed prompts and stops at the largest TP size; every rank exits by itself
(the process table is the oracle: none had to be killed after the shutdown grace) and nothing is left behind.

Its engine is watched like every check's (``steps.start`` under ``leftovers.watched``); what it left is the verdict
``leftovers.reported_after`` gives it, as it gives load, budget, lora and quant theirs.
"""

from __future__ import annotations

from typing import Any

from pytest_enginecheck.checks import CheckContext
from pytest_enginecheck.targets.vllm.checks.steps import apart, engine_inputs, fits, start


def run_startup(ctx: CheckContext, mode: str = "warm") -> dict[str, Any]:
    """startup: vLLM starts, serves requests and stops at the largest TP size; no rank is killed, no process, fd,
    temp entry or shm segment is left."""
    ckpt, args = apart(ctx, engine_inputs)
    tp = max(t for t in (*ctx.options.tp_sizes, 1) if t == 1 or fits(ckpt, t))
    run = start(ctx, ckpt, tp, mode, args)
    return {"tensor_parallel_size": tp, "dtype": args["dtype"], "seconds": run.seconds,
            "leftovers": "none: no rank was killed, nothing was left (processes, descriptors, sockets, /dev/shm, "
                         "entries in /tmp and the working directory)"}
