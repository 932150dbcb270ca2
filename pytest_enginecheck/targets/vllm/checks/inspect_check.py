"""inspect on vLLM: vLLM's ModelInfo of the class, built in the warm fork (``--enginecheck-inspect=fork``) or by vLLM's
own subprocess; in fork mode the import check's clean import builds the verdict once for both checks.
"""

from __future__ import annotations

import os
import signal
import time
from typing import Any

from pytest_enginecheck.checks import CheckContext, CheckFailure
from pytest_enginecheck.checks.failures import cuda_failure
from pytest_enginecheck.targets.vllm import INSPECT
from pytest_enginecheck.targets.vllm.checks.steps import inspection_failure, model_class, registry_entry
from pytest_enginecheck.targets.vllm.describe import registry


def _inspect_fork(ctx: CheckContext, entry: registry.VllmArch, model_cls: type) -> dict[str, Any]:
    """The fork-mode inspect verdict for ``model_cls``: its ModelInfo, or the CheckFailure inspect fails with."""
    try:
        info, accesses = registry.inspect_in_fork(model_cls, strict=ctx.options.strict)
    except Exception as e:  # noqa: BLE001 - the class's own error while vLLM inspects it
        raise inspection_failure(ctx, e) from None
    if accesses:
        raise cuda_failure(f"Inspecting {ctx.architecture}", accesses[0], entry.module)
    return {**info, "cache": "--enginecheck-inspect=fork builds each ModelInfo without vLLM's modelinfos cache"}


STORE_TIMEOUT_S = 15.0  # for the import check's fork building the inspect verdict (a ModelInfo takes milliseconds)


def inspection_path(ctx: CheckContext) -> str:
    """Where the import check leaves the fork-mode inspect verdict of ``ctx``'s architecture, in the session's
    workdir (shared by its checks; each pytest-xdist worker and pytest-split shard has its own)."""
    strict = "-strict" if ctx.options.strict else ""
    return os.path.join(ctx.workdir, "vllm-inspect", f"{ctx.architecture}-fork{strict}.pickle")


def store_inspection_apart(ctx: CheckContext, entry: registry.VllmArch, model_cls: type) -> None:
    """``_store_inspection`` in a fork of this (import) check's process, which has the module imported already: a
    crash or a hang of vLLM's ModelInfo building there stores nothing, so it can never become the import's verdict
    (the inspect check then inspects by itself and reports it). Bounded by STORE_TIMEOUT_S."""
    pid = os.fork()
    if pid == 0:  # the grandchild: build, store, leave without running this process's exit handlers
        try:
            _store_inspection(ctx, entry, model_cls)
        finally:
            os._exit(0)
    deadline = time.monotonic() + min(STORE_TIMEOUT_S, ctx.options.timeout * 0.2)
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
    """inspect: vLLM's ModelInfo, built in this warm fork (``--enginecheck-inspect=fork``) or by vLLM's own
    subprocess ("subprocess"). A failure's first line starts with its cause (CI logs cut FAILED lines).

    In fork mode, the verdict the import check built after a clean import in this session's workdir is used as
    is; without one (the import failed, or ran in another worker or shard) this check imports by itself."""
    mode = INSPECT.value(ctx.options)
    if mode == "fork" and (stored := _stored_inspection(ctx)) is not None:
        return stored
    entry = registry_entry(ctx)
    if mode == "subprocess":
        try:
            return registry.inspect_in_subprocess(ctx.architecture)
        except registry.InspectionError as e:
            raise CheckFailure(f"{e.cause} (vLLM's inspection subprocess, inspecting {ctx.architecture})\n{e.output}",
                               {"kind": "inspection", "mode": mode}) from None
    return _inspect_fork(ctx, entry, model_class(ctx, entry))
