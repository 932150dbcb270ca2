"""The start method of engine_ref's children, and the one stdlib hook it installs.

forkserver (default): forks of a warm server that preloaded torch. fork: forks of this process,
refused with a warning (spawn instead) once this process has initialized CUDA. spawn: a fresh
interpreter per child (slow; for platforms without fork).
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.spawn
import sys
import threading
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from multiprocessing.context import ForkContext, ForkServerContext, SpawnContext
from typing import Any, cast

from engine_ref import envs
from engine_ref.errors import ConfigError
from engine_ref.isolation.tempdirs import adopt_multiprocessing_tempdir

PRELOAD_MODULES = ["engine_ref.warmup"]  # extend with add_preload_modules()
START_METHODS = ("forkserver", "spawn", "fork")
MPContext = ForkServerContext | SpawnContext | ForkContext

# True in a child started by start_process: its own children fork from it and join its group.
_in_isolated_group = False
# Set while this thread starts one of our children: see _preparation_data.
_launching = threading.local()
_original_get_preparation_data = multiprocessing.spawn.get_preparation_data


def cuda_initialized() -> bool:
    """Whether this process has initialized CUDA (without importing torch to find out)."""
    torch = sys.modules.get("torch")
    return bool(torch is not None and torch.cuda.is_initialized())


def in_isolated_group() -> bool:
    """Whether this process is a child started by ``start_process``."""
    return _in_isolated_group


def enter_isolated_group() -> None:
    """Mark this process as one of our children: its own children fork from it (it is warm)."""
    global _in_isolated_group
    _in_isolated_group = True


def _preparation_data(name: str) -> dict[str, Any]:
    """multiprocessing's preparation data, minus the parent's ``__main__`` for our own children.

    multiprocessing re-imports the parent's main module in every forkserver or spawn child, so
    that targets defined there unpickle. Ours travel by cloudpickle and never need it, and under
    the ``pytest`` console script that import alone costs a child ~150 ms (it imports pytest).
    Other callers of multiprocessing are unaffected: the flag is per thread and set only by us.
    """
    data = _original_get_preparation_data(name)
    if getattr(_launching, "active", False):
        data.pop("init_main_from_path", None)
        data.pop("init_main_from_name", None)
    return data


# Installed once, on import: it changes nothing until ``launching()`` sets this thread's flag.
multiprocessing.spawn.get_preparation_data = _preparation_data


@contextmanager
def launching() -> Iterator[None]:
    """While a child of ours starts: it does not re-import this process's ``__main__``."""
    _launching.active = True
    try:
        yield
    finally:
        _launching.active = False


def get_mp_context() -> MPContext:
    """The multiprocessing context children start from (ENGINE_REF_WORKER_MULTIPROC_METHOD).

    See the module docstring. A child of ours forks its own children: it is warm itself.
    """
    method = envs.worker_multiproc_method()
    if _in_isolated_group and method == "forkserver":
        method = "fork"
    if method not in START_METHODS:
        raise ConfigError(
            f"ENGINE_REF_WORKER_MULTIPROC_METHOD={method!r} is unknown; use one of {', '.join(START_METHODS)}."
        )
    if method == "fork" and cuda_initialized():
        warnings.warn(
            "This process has initialized CUDA, and a forked child cannot use CUDA "
            "('Cannot re-initialize CUDA in forked subprocess'); starting workers with 'spawn' instead. "
            "Use the default 'forkserver' method, or avoid touching CUDA before the engine starts.",
            RuntimeWarning,
            stacklevel=3,
        )
        method = "spawn"
    if method not in multiprocessing.get_all_start_methods():
        method = "spawn"
    ctx = cast(MPContext, multiprocessing.get_context(method))
    if ctx.get_start_method() == "forkserver":
        ctx.set_forkserver_preload(PRELOAD_MODULES)
        adopt_multiprocessing_tempdir()  # the forkserver's socket: in this process's temp dir, swept if it is killed
    return ctx


def add_preload_modules(*names: str) -> None:
    """Also import these modules in the warm parent (they must import no model and touch no CUDA).

    Takes effect when the warm parent starts, so call it before the first child.
    """
    PRELOAD_MODULES.extend(n for n in names if n not in PRELOAD_MODULES)


def ensure_warm_parent() -> None:
    """Start the warm parent now (it otherwise starts on the first child), e.g. before a leak snapshot."""
    ctx = get_mp_context()
    if ctx.get_start_method() == "forkserver":
        from multiprocessing import forkserver

        forkserver.ensure_running()
