"""engine_ref: a small, readable reference LLM engine with vLLM's startup path.

Importing the package is cheap (no torch): names are imported on first use.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_EXPORTS = {
    "LLM": "engine_ref.entrypoints.llm",
    "EngineArgs": "engine_ref.engine.arg_utils",
    "EngineConfig": "engine_ref.config",
    "EngineCore": "engine_ref.engine.core",
    "StartupReport": "engine_ref.engine.report",
    "ModelRegistry": "engine_ref.model_executor.models.registry",
    "ModelInfo": "engine_ref.model_executor.models.interfaces",
    "make_checkpoint": "engine_ref.model_executor.model_loader.checkpoint",
    "load_general_plugins": "engine_ref.plugins",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'engine_ref' has no attribute {name!r}")
