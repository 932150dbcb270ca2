"""Plain helpers the vLLM target's pure tests share: a module loaded from a file, a checkpoint directory of a
config alone."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any


def _load_file(path: Path, name: str) -> Any:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _ckpt(tmp_path: Path, **config: Any) -> str:
    (tmp_path / "config.json").write_text(json.dumps(config))
    return str(tmp_path)
