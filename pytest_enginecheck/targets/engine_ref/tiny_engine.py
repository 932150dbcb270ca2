"""Shared by load, budget and startup: a tiny checkpoint of the architecture and an engine on it."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from pytest_enginecheck.checks import CheckContext, CheckFailure, CheckSkip

DEVICE_MEMORY = "512MiB"
MAX_MODEL_LEN = 128
MAX_TOKENS = 6


def tiny_checkpoint(ctx: CheckContext, registry: Any, quantization: str | None = None) -> Path:
    """The architecture's tiny checkpoint under the session's workdir, generated once (atomically);
    with ``quantization``, its pre-quantized twin (the same weights, quantized).

    ``registry`` is the target's, from ``engine_ref_registry`` (resolved once per check process).
    """
    from engine_ref.errors import ConfigError
    from engine_ref.model_executor.model_loader.checkpoint import make_checkpoint
    from engine_ref.model_executor.model_loader.quantized_checkpoint import make_quantized_checkpoint

    name = ctx.architecture if quantization is None else f"{ctx.architecture}-{quantization}"
    path = Path(ctx.workdir) / name
    if (path / "config.json").exists():
        return path
    tmp = Path(tempfile.mkdtemp(dir=ctx.workdir, prefix=f".{name}-"))
    try:
        if quantization is None:
            make_checkpoint(ctx.architecture, tmp, registry=registry)
        else:
            make_quantized_checkpoint(ctx.architecture, tmp, quantization, registry=registry)
        os.replace(tmp, path)
    except ConfigError as e:
        raise CheckSkip(f"no tiny checkpoint can be made: {e}") from None
    except OSError:  # another process of this session made it first
        pass
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return path


def verify_tp(ckpt: Path, tp: int) -> None:
    """Skip when the architecture's heads cannot be split over ``tp`` ranks."""
    from engine_ref.config import ModelConfig, verify_tensor_parallel_size
    from engine_ref.errors import ConfigError

    try:
        verify_tensor_parallel_size(ModelConfig(str(ckpt)), tp)
    except ConfigError as e:
        raise CheckSkip(str(e)) from None


def prompts(vocab_size: int) -> list[list[int]]:
    """Three fixed prompts of different lengths inside the vocabulary."""
    return [[(7 * i + 3) % vocab_size for i in range(n)] for n in (3, 8, 17)]


def start_engine(ctx: CheckContext, ckpt: Path, tp: int, **kwargs: Any) -> Any:
    """An LLM on the tiny checkpoint; engine errors become CheckFailure with the engine's own words."""
    from engine_ref.entrypoints.llm import LLM
    from engine_ref.errors import EngineRefError

    options = {"device_memory": DEVICE_MEMORY, "max_model_len": MAX_MODEL_LEN,
               "ready_timeout_s": max(1.0, ctx.options.timeout * 0.8), **kwargs}
    try:
        return LLM(str(ckpt), tensor_parallel_size=tp, **options)
    except EngineRefError as e:
        raise CheckFailure(f"{ctx.architecture} failed to start at tensor_parallel_size={tp}: {e}",
                           {"kind": type(e).__name__}) from None


def greedy(ctx: CheckContext, ckpt: Path, tp: int, seed: int = 0) -> tuple[list[list[int]], Any]:
    """Greedy tokens for the fixed prompts at ``tp`` (the engine's ``seed``), and the startup report."""
    with start_engine(ctx, ckpt, tp, seed=seed) as llm:
        vocab = llm.engine.config.model_config.hf_text_config.vocab_size
        return llm.generate(prompts(vocab), max_tokens=MAX_TOKENS, ignore_eos=True), llm.startup_report
