"""The steps the vLLM target's checks share: the registry entry and class under the guard, the tiny checkpoint and
dtype decided apart from the check process, an engine start whose failures become the check's verdict (or a skip
naming the checker's limit), one start shared by the checks of a session.
"""

from __future__ import annotations

import os
import traceback
from collections.abc import Callable
from typing import Any, TypeVar, cast

from pytest_enginecheck.checks import CheckContext, CheckFailure, CheckSkip
from pytest_enginecheck.checks.failures import cuda_failure, import_failure, missing_class, rank_cuda_failure
from pytest_enginecheck.targets.vllm.checkpoints.declared import ConfigDeclarationError
from pytest_enginecheck.targets.vllm.checkpoints.shrink import NoTinyCheckpoint
from pytest_enginecheck.targets.vllm.checkpoints.tiny import is_tiny_checkpoint, tiny_checkpoint
from pytest_enginecheck.targets.vllm.checks import leftovers
from pytest_enginecheck.targets.vllm.describe import registry
from pytest_enginecheck.targets.vllm.engine import cuda_ranks
from pytest_enginecheck.targets.vllm.engine.drive import EngineRun, EngineStartError, EngineWork
from pytest_enginecheck.targets.vllm.engine.dtype import engine_dtype
from pytest_enginecheck.targets.vllm.engine.run import run_engine
from pytest_enginecheck.targets.vllm.env import ENGINE_ARGS, redirect_caches
from pytest_enginecheck.targets.vllm.limits import checker_limit, in_process_artifact
from pytest_enginecheck.targets.vllm.probe import GENERATING_KINDS, MIXED_KINDS, probe

T = TypeVar("T")


def registry_entry(ctx: CheckContext) -> registry.VllmArch:
    redirect_caches(ctx.workdir)
    entries = {e.architecture: e for e in registry.list_architectures(strict=ctx.options.strict)}
    if ctx.architecture not in entries:
        raise CheckFailure(f"{ctx.architecture} is no longer in vLLM's registry (was its plugin removed?)",
                           {"kind": "missing_architecture"})
    return entries[ctx.architecture]


def model_class(ctx: CheckContext, entry: registry.VllmArch) -> type:
    """The architecture's class, imported and looked up under the guard; failures as the import check words them."""
    result = registry.import_model_class(entry, strict=ctx.options.strict)
    if result.accesses:  # a CUDA initialization before any (strict) query: it is the worse
        first = next((a for a in result.accesses if a.kind != "query"), result.accesses[0])
        raise cuda_failure(f"Importing {entry.module}", first, entry.module)
    if isinstance(result.error, AttributeError) and entry.module in str(result.error):
        raise missing_class(ctx, entry.module, entry.class_name)
    if result.error is not None:
        raise import_failure(ctx, result.error)
    assert result.model_cls is not None
    return result.model_cls


def inspection_failure(ctx: CheckContext, e: Exception, before: str = "") -> CheckFailure:
    """The failure of vLLM's ModelInfo building raising ``e`` (in an ``except`` block: its traceback is the
    detail's), as the inspect check words it; with ``before``, a dependent check's words in front. Its cause
    (``checks.causes``) is the same either way: the exception."""
    return CheckFailure(f"{before}{type(e).__name__}: {e} (vLLM inspecting {ctx.architecture})",
                        {"kind": "inspection", "mode": "fork", "traceback": traceback.format_exc()})


def engine_checkpoint(ctx: CheckContext) -> str:
    reason = probe().cpu_backend()
    if reason:
        raise CheckSkip(reason)
    entry = registry_entry(ctx)
    model_cls = model_class(ctx, entry)
    kind = probe().model_kinds.get(ctx.architecture)
    if kind is not None and kind not in (*GENERATING_KINDS, *MIXED_KINDS):
        article = "an" if kind[0] in "aeiou" else "a"
        raise CheckSkip(f"vLLM registers {ctx.architecture} as {article} {kind} model: the engine checks compare "
                        f"generated tokens")
    try:
        info, _ = registry.inspect_in_fork(model_cls)
    except Exception as e:  # noqa: BLE001 - the inspect check's failure, for the same cause
        raise inspection_failure(ctx, e, "vLLM cannot inspect the class, so no engine starts (the inspect check "
                                          "fails for it too): ") from None
    if not info.get("is_text_generation_model", True):
        raise CheckSkip(f"{ctx.architecture} is not a text generation model (vLLM's ModelInfo): the engine checks "
                        f"compare generated tokens")
    try:
        return str(tiny_checkpoint(ctx.architecture, ctx.workdir, model_cls))
    except NoTinyCheckpoint as e:
        raise CheckSkip(f"no tiny checkpoint can be made: {e}") from None
    except ConfigDeclarationError as e:  # the author's declaration, not a limit of the checker
        raise CheckFailure(str(e), {"kind": "config_declaration"}) from None


def apart(ctx: CheckContext, fn: Callable[[CheckContext], T]) -> T:
    """``fn(ctx)`` in a fork of this check's process, which so never imports the model's module: the ranks it forks
    next start as vLLM's own do, before any module the model imports. (vLLM's kimi_k3 module imports numba, which
    broke vLLM CPU's Triton-kernel rebinding scan in every rank forked after it.)"""
    from engine_ref.isolation import run_isolated

    return cast(T, run_isolated(fn, ctx, timeout=ctx.options.timeout,
                                name=f"vllm-{fn.__name__.strip('_')}:{ctx.architecture}"))


def engine_inputs(ctx: CheckContext) -> tuple[str, dict[str, Any]]:
    """The tiny checkpoint and the engine arguments (``dtype_args``) load, budget and startup start vLLM with."""
    ckpt = engine_checkpoint(ctx)
    return ckpt, dtype_args(ctx, ckpt)


def dtype_args(ctx: CheckContext, ckpt: str) -> dict[str, Any]:
    """The engine arguments load, budget and startup start vLLM with: the dtype ``engine.engine_dtype`` decides
    (bfloat16 for a model vLLM builds with MLA attention, whose CPU backend takes no float32 weights)."""
    transformers_backend = model_class(ctx, registry_entry(ctx)).__name__.startswith("Transformers")
    return {"dtype": engine_dtype(ckpt, transformers_backend)}


def start(ctx: CheckContext, ckpt: str, tp: int, mode: str, engine_args: dict[str, Any] | None = None,
          work: EngineWork | None = None) -> EngineRun:
    """``start_or_spawn`` under the leftover watch (``leftovers.watched``: what it left goes into the run, and into the
    check's verdict), its EngineStartError the check's verdict: a CheckSkip naming the checker's limit on its own tiny
    checkpoint (``limits.checker_limit``), else a CheckFailure naming phase and rank."""
    dtype = str((engine_args or {}).get("dtype", ENGINE_ARGS["dtype"]))
    # --enginecheck-strict: every warm rank runs the model's code under the CUDA guard (engine.cuda_ranks)
    guarded_module = (ctx.module or apart(ctx, _registered_module)) if ctx.options.strict else ""
    try:
        with leftovers.watched() as left, cuda_ranks.guarded_ranks(guarded_module):
            run = start_or_spawn(ctx, ckpt, tp, mode, engine_args, work)
        run.leftovers, run.dtype = left, dtype
        return leftovers.used(run)
    except EngineStartError as e:
        guarded = e.failure if isinstance(e.failure, cuda_ranks.RankCudaFailure) else None
        if guarded is None:
            limit = checker_limit(e.failure) if is_tiny_checkpoint(ckpt, ctx.workdir) else None
            if limit:  # a limit of the checker's tiny checkpoint on vLLM's CPU backend (limits.py), not the model's
                raise CheckSkip(f"vLLM's engine cannot run the checker's tiny checkpoint of {ctx.architecture} at "
                                f"tensor_parallel_size={tp} ({dtype}) in phase {e.failure.phase}: {limit}") from None
            raise CheckFailure(e.failure.describe(ctx.architecture, tp, dtype),
                               {"kind": "engine", "phase": e.failure.phase, "rank": e.failure.rank, "dtype": dtype,
                                "traceback": e.failure.traceback}) from None
    # A rank's model touched or queried CUDA: raised outside the except, so its cause is its kind (checks.failures)
    hint = cuda_ranks.BUILD_HINT if guarded.stage == "build" else cuda_ranks.FORWARD_HINT
    raise rank_cuda_failure(ctx, guarded.cuda_access, guarded.stage, guarded.rank, guarded.world_size,
                            f"vLLM's {guarded.phase}", cuda_ranks.GUARD, hint)


def _registered_module(ctx: CheckContext) -> str:
    """The module vLLM's registry names for the architecture (plugins loaded in a fork: ``apart``)."""
    return registry_entry(ctx).module


def start_or_spawn(ctx: CheckContext, ckpt: str, tp: int, mode: str, engine_args: dict[str, Any] | None,
                   work: EngineWork | None = None) -> EngineRun:
    """``run_engine`` in ``mode``; where the warm layout (front end and worker one process) is what failed
    (``limits.in_process_artifact``), again in vLLM's own layout, driven from a fork: this process may fork ranks
    again (a TP comparison's other size), which a process that ran vLLM's engine must not."""
    from engine_ref.isolation import run_isolated

    timeout = max(10.0, ctx.options.timeout * 0.8)
    try:
        return run_engine(ckpt, tp, mode, timeout=timeout, engine_args=engine_args, work=work)
    except EngineStartError as e:
        if mode != "warm" or not in_process_artifact(e.failure):
            raise
    return cast(EngineRun, run_isolated(run_engine, ckpt, tp, "spawn", timeout, timeout=timeout,
                                        name=f"vllm-spawn:{ctx.architecture}", engine_args=engine_args,
                                        work=work))


def shared_run(ctx: CheckContext, ckpt: str, tp: int, mode: str, engine_args: dict[str, Any] | None = None,
               kind: str = "", work: EngineWork | None = None) -> EngineRun:
    """``start``, once per (architecture, TP, mode) for load and budget: its EngineRun is kept as JSON in the
    session's workdir and read back by the next check that asks. A start with other ``engine_args`` or ``work`` is
    shared under its own ``kind`` (``lora``: per TP size for lora[tp=1] and lora[tp=N])."""
    import json
    from dataclasses import asdict

    path = os.path.join(ctx.workdir, "vllm-runs", f"{ctx.architecture}-tp{tp}-{mode}{'-' + kind if kind else ''}.json")
    if os.path.exists(path):
        with open(path) as f:
            return leftovers.used(EngineRun(**json.load(f)))
    run = start(ctx, ckpt, tp, mode, engine_args, work)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path + ".tmp", "w") as f:
        json.dump(asdict(run), f)
    os.replace(path + ".tmp", path)
    return run


def verify_tp(ckpt: str, tp: int) -> None:
    import json

    with open(os.path.join(ckpt, "config.json")) as f:
        config = json.load(f)
    heads = config.get("num_attention_heads") or config.get("text_config", {}).get("num_attention_heads", 1)
    if heads % tp:
        raise CheckSkip(f"num_attention_heads={heads} cannot be split over tensor_parallel_size={tp}")


def fits(ckpt: str, tp: int) -> bool:
    try:
        verify_tp(ckpt, tp)
    except CheckSkip:
        return False
    return True
