"""lora: a tiny PEFT adapter loads into the slots the engine preallocates at TP=N, changes greedy tokens as at
TP=1, and at TP=1 computes what the architecture's reference computes with PEFT's adapter.

The architecture's tiny checkpoint gets a random adapter (``make_lora``, fixed seed) on every module
LoRA can run on. The engine starts at TP=N with ``enable_lora=True``; greedy tokens with the adapter
must differ from the tokens without it (the LoRA layers are applied). At TP=N they must equal TP=1's with
the adapter (A and B shard as the base layers do); at TP=1, the model's log-probabilities with the adapter
and without it must equal those of its reference implementation (``find_reference``) with the same adapter
loaded by PEFT (``lora_oracle``), which catches what is wrong at every TP size alike (an adapter that one
target module never applies). Without a reference the detail's ``oracle`` is ``self`` and says why.
Architectures whose class does not declare SupportsLoRA skip.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from pytest_enginecheck.checks import CheckContext, CheckFailure, CheckSkip
from pytest_enginecheck.targets.engine_ref import cuda_ranks, lora_oracle
from pytest_enginecheck.targets.engine_ref.registry import engine_ref_registry
from pytest_enginecheck.targets.engine_ref.tiny_engine import (
    MAX_TOKENS,
    checkpoint_prompts,
    start_engine,
    tiny_checkpoint,
    verify_tp,
)

LORA_RANK = 8
MAX_LORAS = 2


def tiny_adapter(ctx: CheckContext, ckpt: Path) -> Path:
    """The architecture's tiny adapter under the session's workdir, made once (atomically)."""
    from engine_ref.errors import EngineRefError
    from engine_ref.lora.checkpoint import make_lora

    path = Path(ctx.workdir) / f"{ctx.architecture}-lora"
    if (path / "adapter_config.json").exists():
        return path
    tmp = Path(tempfile.mkdtemp(dir=ctx.workdir, prefix=f".{ctx.architecture}-lora-"))
    try:
        make_lora(ckpt, tmp, r=LORA_RANK, seed=0)
        os.replace(tmp, path)
    except EngineRefError as e:
        raise CheckFailure(f"No LoRA adapter can be made for {ctx.architecture}: {e}", {"kind": "make_lora"}) from None
    except OSError:  # another process of this session made it first
        pass
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return path


def generate(ctx: CheckContext, ckpt: Path, tp: int, adapter: Path) -> tuple[list[list[int]], list[list[int]], Any]:
    """Greedy tokens of the fixed prompts with the adapter and without it at ``tp``, and the startup report."""
    from engine_ref.errors import EngineRefError
    from engine_ref.lora.request import LoRARequest

    with start_engine(ctx, ckpt, tp, enable_lora=True, max_loras=MAX_LORAS, max_lora_rank=LORA_RANK) as llm:
        batch = checkpoint_prompts(ckpt)
        try:
            with_lora = cuda_ranks.generate(ctx, llm, batch, max_tokens=MAX_TOKENS, ignore_eos=True,
                                            lora_request=LoRARequest("enginecheck", 1, str(adapter)))
            without = cuda_ranks.generate(ctx, llm, batch, max_tokens=MAX_TOKENS, ignore_eos=True)
        except EngineRefError as e:
            raise CheckFailure(f"{ctx.architecture} at tensor_parallel_size={tp} failed to generate with a LoRA "
                               f"adapter: {e}", {"kind": type(e).__name__}) from None
        return with_lora, without, llm.startup_report


def run(ctx: CheckContext) -> dict[str, Any]:
    from engine_ref.model_executor.models.interfaces import ModelInfo

    registry = engine_ref_registry(ctx.spec)
    model_cls = registry.resolve_model_cls(ctx.architecture)
    info = ModelInfo.from_model_cls(ctx.architecture, model_cls)
    if not info.supports_lora:
        raise CheckSkip(f"{ctx.architecture} does not declare SupportsLoRA, so the engine refuses enable_lora for it")
    ckpt = tiny_checkpoint(ctx, registry)
    verify_tp(ckpt, ctx.tp)
    reference, why = lora_oracle.find_lora_reference(ctx, model_cls) if ctx.tp == 1 else (None, "")
    adapter = tiny_adapter(ctx, ckpt)
    with_lora, without, report = generate(ctx, ckpt, ctx.tp, adapter)
    detail: dict[str, Any] = {"tensor_parallel_size": ctx.tp, "max_loras": MAX_LORAS, "max_lora_rank": LORA_RANK,
                              "lora_bytes_per_rank": [w.memory.lora for w in report.workers],
                              "outputs": with_lora, "base_outputs": without}
    if with_lora == without:
        raise CheckFailure(
            f"At tensor_parallel_size={ctx.tp}, {ctx.architecture} generates the same tokens with a LoRA adapter as "
            f"without it: its LoRA layers are not applied. Check that the model calls the layers LoRA wraps "
            f"(their forward), not their weights directly.", {**detail, "kind": "lora_not_applied"})
    if ctx.tp == 1:
        if reference is None:
            return {**detail, "oracle": "self", "oracle_why": why}
        return {**detail, **lora_oracle.verify_reference(ctx, ckpt, adapter, reference, with_lora, without, LORA_RANK)}
    tp1, _, _ = generate(ctx, ckpt, 1, adapter)
    detail["reference"] = tp1
    mismatched = [i for i, (a, b) in enumerate(zip(with_lora, tp1, strict=True)) if a != b]
    if mismatched:
        i = mismatched[0]
        raise CheckFailure(
            f"At tensor_parallel_size={ctx.tp}, {ctx.architecture} with a LoRA adapter generates different tokens "
            f"than at tensor_parallel_size=1 (prompt {i}: {with_lora[i]} vs {tp1[i]}): the adapter's A or "
            f"B is sharded unlike its base layer. Check the output_shard / input_start of the layers this model "
            f"changed: LoRA reads its slices from them.", {**detail, "kind": "tp_mismatch"})
    return detail
