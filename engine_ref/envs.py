"""Environment variables engine_ref reads, in one place. Read at call time, never cached.

A value that does not parse raises ConfigError naming the variable, its value and what it takes.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

from engine_ref.errors import ConfigError

WORKER_MULTIPROC_METHODS = ("forkserver", "spawn", "fork")


def cache_root() -> Path:
    """ENGINE_REF_CACHE_ROOT, else $XDG_CACHE_HOME/engine_ref, else ~/.cache/engine_ref."""
    root = os.environ.get("ENGINE_REF_CACHE_ROOT")
    if root:
        return Path(root).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(xdg) / "engine_ref"


def allowed_plugins() -> list[str] | None:
    """ENGINE_REF_PLUGINS: comma-separated plugin names to load; unset means all, empty means none."""
    value = os.environ.get("ENGINE_REF_PLUGINS")
    if value is None:
        return None
    return [name.strip() for name in value.split(",") if name.strip()]


def positive_seconds(name: str) -> float | None:
    """The environment variable ``name`` as a finite, positive number of seconds; None when unset or empty."""
    value = os.environ.get(name, "").strip()
    if not value:
        return None
    try:
        seconds = float(value)
    except ValueError:
        seconds = math.nan
    if not (math.isfinite(seconds) and seconds > 0):
        raise ConfigError(f"{name}={value!r} is not a number of seconds; set it to a finite positive number "
                          f"such as 300, or unset it.")
    return seconds


def trace_dir() -> str | None:
    """ENGINE_REF_TRACE_DIR: a directory where every engine start writes its startup trace (engine_ref.tracing)."""
    return os.environ.get("ENGINE_REF_TRACE_DIR") or None


def ready_timeout_s() -> float | None:
    """ENGINE_REF_READY_TIMEOUT_S: how long workers may take to load before startup fails."""
    return positive_seconds("ENGINE_REF_READY_TIMEOUT_S")


def rpc_timeout_s() -> float | None:
    """ENGINE_REF_RPC_TIMEOUT_S: how long each call to the workers (a generate step) may take."""
    return positive_seconds("ENGINE_REF_RPC_TIMEOUT_S")


def collective_timeout_s() -> float | None:
    """ENGINE_REF_COLLECTIVE_TIMEOUT_S: how long a rank waits for the others in one collective (an all-reduce)."""
    return positive_seconds("ENGINE_REF_COLLECTIVE_TIMEOUT_S")


CUDA_GUARD_VARIABLE = "ENGINE_REF_CUDA_GUARD"
CUDA_GUARD_MODES = ("strict",)


def cuda_guard() -> str | None:
    """ENGINE_REF_CUDA_GUARD: ``strict`` builds and runs every rank's model under engine_ref's CUDA guard
    (engine_ref.worker.cuda_guard); unset or empty: no guard."""
    value = os.environ.get(CUDA_GUARD_VARIABLE, "").strip()
    if not value:
        return None
    if value not in CUDA_GUARD_MODES:
        raise ConfigError(f"{CUDA_GUARD_VARIABLE}={value!r} is unknown; set it to 'strict' (a rank whose model "
                          f"touches or queries CUDA while it is built or run fails), or unset it.")
    return value


def worker_multiproc_method() -> str:
    """ENGINE_REF_WORKER_MULTIPROC_METHOD: forkserver (default), spawn or fork."""
    value = os.environ.get("ENGINE_REF_WORKER_MULTIPROC_METHOD", "").strip() or "forkserver"
    if value not in WORKER_MULTIPROC_METHODS:
        raise ConfigError(f"ENGINE_REF_WORKER_MULTIPROC_METHOD={value!r} is unknown; use one of "
                          f"{', '.join(WORKER_MULTIPROC_METHODS)}, or unset it.")
    return value
