"""The fixture the vLLM target's pure tests share: a fake ``vllm`` tree where no vLLM is installed."""

from __future__ import annotations

import importlib
import importlib.util
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

FAKE_VLLM = {
    "vllm/__init__.py": '__version__ = "0.0.fake"\n\n\nclass LLM:\n    def collective_rpc(self, fn):\n'
                        '        return []\n\n\nclass SamplingParams:\n'
                        '    def __init__(self, logprobs=None, prompt_logprobs=None):\n        pass\n',
    "vllm/utils/__init__.py": "",
    "vllm/utils/network_utils.py": "def get_open_port():\n    return 12345\n",
    "vllm/distributed/__init__.py": "",
    "vllm/distributed/parallel_state.py": "def cleanup_dist_env_and_memory():\n    pass\n",
    "vllm/model_executor/__init__.py": "",
    "vllm/model_executor/model_loader/__init__.py": "",
    "vllm/model_executor/model_loader/utils.py": "def initialize_model(vllm_config, prefix=''):\n    pass\n",
    "vllm/envs.py": "VLLM_PLUGINS = ['clean']\n",
}


@pytest.fixture
def fake_vllm(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """``make(files, drop=())``: a fake ``vllm`` tree (FAKE_VLLM, without ``drop``, plus ``files``) on sys.path,
    with the probe's caches cleared before and after."""
    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("a fake vllm tree stands in for vLLM only where none is installed (the project venv)")
    from pytest_enginecheck.targets.vllm import probe

    cached = [probe.probe, probe.sharding_api, probe.logprobs_api, probe.engine_api, probe.model_initializer]

    def forget() -> None:
        for fn in cached:
            fn.cache_clear()
        for name in [m for m in sys.modules if m == "vllm" or m.startswith("vllm.")]:
            del sys.modules[name]
        importlib.invalidate_caches()

    def make(files: dict[str, str] | None = None, drop: tuple[str, ...] = ()) -> Path:
        root = tmp_path / "site"
        for name, text in {**FAKE_VLLM, **(files or {})}.items():
            if name not in drop:
                (root / name).parent.mkdir(parents=True, exist_ok=True)
                (root / name).write_text(text)
        monkeypatch.syspath_prepend(str(root))
        forget()
        return root

    yield make
    forget()
