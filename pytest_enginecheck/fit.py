"""``python -m pytest_enginecheck.fit CONFIG --engine vllm --tp 2 --gpu-memory 80GiB --max-model-len 32768``

Will this model fit on the engine at that TP size, on GPUs of that size? Predicted on a CPU from the engine's own
model class and sizing (for vLLM: ``targets/vllm/fit``), printed as the engine's startup log lines would read;
``--json`` for machines. Run it with the Python that has the engine installed. See docs/fit.md.

This module names no engine: ``--engine`` is an installed target's name, and the target's ``fit.command`` module
(``predict(args)``, ``INPUT_ERRORS``) does the rest.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from collections.abc import Sequence
from types import ModuleType

from pytest_enginecheck.targets import TargetError, load_target, target_names


def parser() -> argparse.ArgumentParser:
    """The command's arguments (vLLM's names for the engine's options)."""
    p = argparse.ArgumentParser(prog="python -m pytest_enginecheck.fit",
                                description="Predict whether a model fits an engine on GPUs of a given size, from "
                                            "its config.json, on a CPU (docs/fit.md).")
    p.add_argument("config", help="the model's config.json (a file, or the directory holding it)")
    p.add_argument("--engine", required=True, help=f"the engine: an installed target ({', '.join(target_names())})")
    p.add_argument("--tp", "--tensor-parallel-size", dest="tp", type=int, default=1, metavar="N",
                   help="tensor_parallel_size (default: 1)")
    p.add_argument("--gpu-memory", required=True, metavar="SIZE", help="each GPU's memory, e.g. 80GiB")
    p.add_argument("--max-model-len", type=int, metavar="TOKENS", help="max_model_len (default: the model's)")
    p.add_argument("--dtype", default="auto", help="the weights' dtype (default: auto, the checkpoint's)")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9, metavar="FRACTION",
                   help="the fraction of each GPU the engine may use (default: 0.9)")
    p.add_argument("--max-num-batched-tokens", type=int, metavar="TOKENS",
                   help="tokens per step, the profile run's size (default: the engine's for that GPU size)")
    p.add_argument("--max-num-seqs", type=int, metavar="N", help="requests per step (default: the engine's)")
    p.add_argument("--kv-cache-dtype", default="auto", help="the KV cache's dtype, e.g. fp8 (default: auto)")
    p.add_argument("--block-size", type=int, metavar="TOKENS", help="tokens per KV-cache block (default: the "
                                                                    "engine's on CUDA)")
    p.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    p.add_argument("--json", action="store_true", help="print the prediction as JSON")
    return p


def fit_module(engine: str) -> ModuleType:
    """The ``fit.command`` module of the target ``engine`` names; TargetError where it has none."""
    if engine not in target_names():
        raise TargetError(f"--engine={engine!r} is not an installed target; use one of {', '.join(target_names())}")
    package = type(load_target(engine)).__module__
    try:
        return importlib.import_module(f"{package}.fit.command")
    except ModuleNotFoundError as e:
        if e.name not in (f"{package}.fit", f"{package}.fit.command"):
            raise
        raise TargetError(f"--engine={engine!r}: that target predicts no full-size fit (it has no "
                          f"{package}.fit.command); docs/fit.md says which do") from None


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command: 0 when max_model_len fits in the worst case, 1 otherwise, 2 for input it cannot use."""
    args = parser().parse_args(argv)
    try:
        module = fit_module(args.engine)
    except TargetError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        report = module.predict(args)
    except module.INPUT_ERRORS as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(report.to_dict(), indent=2) if args.json else report.render())
    return 0 if report.fits else 1


if __name__ == "__main__":
    sys.exit(main())
