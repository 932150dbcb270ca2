"""Environment variables engine_ref reads, in one place. Read at call time, never cached."""

from __future__ import annotations

import os
from pathlib import Path


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


def ready_timeout_s() -> float | None:
    """ENGINE_REF_READY_TIMEOUT_S: how long workers may take to load before startup fails."""
    value = os.environ.get("ENGINE_REF_READY_TIMEOUT_S")
    return float(value) if value else None


def worker_multiproc_method() -> str:
    """ENGINE_REF_WORKER_MULTIPROC_METHOD: forkserver (default), spawn or fork."""
    return os.environ.get("ENGINE_REF_WORKER_MULTIPROC_METHOD", "forkserver")
