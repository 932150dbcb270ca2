"""Shared by load, budget and startup: a tiny checkpoint of the architecture and an engine on it."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Collection
from pathlib import Path
from typing import Any

from pytest_enginecheck.checks import CheckContext, CheckFailure, CheckSkip
from pytest_enginecheck.prompts import prompt_lengths, prompt_tokens, special_token_ids
from pytest_enginecheck.targets.engine_ref import cuda_ranks
from pytest_enginecheck.targets.engine_ref.leftovers import EngineWatch

DEVICE_MEMORY = "512MiB"
MAX_MODEL_LEN = 128
MAX_TOKENS = 6
BLOCK_SIZE = 16  # the engine's KV block size (engine_ref's default, given explicitly): the prompts cross it


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


def prompts(vocab_size: int, avoid: Collection[int] = ()) -> list[list[int]]:
    """The fixed prompts, one batch of different lengths (pytest_enginecheck/prompts.py) for BLOCK_SIZE,
    MAX_MODEL_LEN and MAX_TOKENS, inside the vocabulary and without the ids of ``avoid``."""
    return prompt_tokens(prompt_lengths(BLOCK_SIZE, MAX_MODEL_LEN, MAX_TOKENS), vocab_size, avoid)


def checkpoint_prompts(ckpt: Path) -> list[list[int]]:
    """The fixed prompts in the vocabulary of ``ckpt``'s config.json, without the token ids it gives a role."""
    config = json.loads((Path(ckpt) / "config.json").read_text())
    vocab = config.get("vocab_size") or config.get("text_config", {}).get("vocab_size")
    return prompts(vocab, special_token_ids(config))


def start_engine(ctx: CheckContext, ckpt: Path, tp: int, **kwargs: Any) -> Any:
    """An LLM on the tiny checkpoint; engine errors become CheckFailure with the engine's own words. Under
    --enginecheck-strict its ranks build and run the model under the CUDA guard (cuda_ranks). Use it as a context
    manager: leaving the block shuts the engine down and records what it left behind (leftovers.EngineWatch), which
    the check's verdict then includes."""
    from engine_ref.entrypoints.llm import LLM
    from engine_ref.errors import EngineRefError

    options = {"device_memory": DEVICE_MEMORY, "max_model_len": MAX_MODEL_LEN, "block_size": BLOCK_SIZE,
               "ready_timeout_s": max(1.0, ctx.options.timeout * 0.8), **kwargs}
    watch = EngineWatch(ctx, tp)  # the engine's whole life: its start, the check's requests, its shutdown
    try:
        with cuda_ranks.guarded_ranks(ctx.options.strict):
            return watch.around(LLM(str(ckpt), tensor_parallel_size=tp, **options))
    except EngineRefError as e:
        watch.cancel()
        found = cuda_ranks.guard_error(e)
        if found is None:
            raise CheckFailure(f"{ctx.architecture} failed to start at tensor_parallel_size={tp}: {e}",
                               {"kind": type(e).__name__}) from None
    except BaseException:
        watch.cancel()
        raise
    raise cuda_ranks.cuda_failure(ctx, found)


def greedy(ctx: CheckContext, ckpt: Path, tp: int, seed: int = 0) -> tuple[list[list[int]], Any]:
    """Greedy tokens for the fixed prompts at ``tp`` (the engine's ``seed``), and the startup report."""
    with start_engine(ctx, ckpt, tp, seed=seed) as llm:
        tokens = cuda_ranks.generate(ctx, llm, checkpoint_prompts(ckpt), max_tokens=MAX_TOKENS, ignore_eos=True)
        return tokens, llm.startup_report
