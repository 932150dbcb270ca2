"""The ``sglang`` tier: runs where SGLang is importable (the cached venv of .ci/sglang-venv).

Elsewhere its tests skip, unless ``ENGINECHECK_REQUIRE_SGLANG=1`` (set by the README's ``# SGLang tier``
command): then a missing SGLang is a usage error, so CI never goes green having run nothing."""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import pytest

from tests.sglang.model_dist import write_model_site

HAS_SGLANG = importlib.util.find_spec("sglang") is not None
REQUIRE_SGLANG = "ENGINECHECK_REQUIRE_SGLANG"


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "sglang: needs SGLang installed (the sglang tier; see .ci/sglang-venv)")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark this tier ``sglang`` and skip it, with one reason, where SGLang is not installed (an error where
    ``ENGINECHECK_REQUIRE_SGLANG=1`` says it must be)."""
    here = Path(__file__).parent
    if not HAS_SGLANG and os.environ.get(REQUIRE_SGLANG) == "1" and any(here in Path(i.path).parents for i in items):
        raise pytest.UsageError(
            f"{REQUIRE_SGLANG}=1 but SGLang is not importable by {sys.executable}: run the sglang tier with the "
            f"venv's pytest (V=$(.ci/sglang-venv | tail -1) && \"$V/bin/pytest\" tests/sglang), or unset "
            f"{REQUIRE_SGLANG} to let its tests skip.")
    skip = pytest.mark.skip(reason="SGLang is not importable here: run the sglang tier in the venv of .ci/sglang-venv")
    for item in items:
        if here in Path(item.path).parents:
            item.add_marker(pytest.mark.sglang)
            if not HAS_SGLANG:
                item.add_marker(skip)


@pytest.fixture(scope="session")
def model_site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A temp site dir holding the out-of-tree model distributions (see model_dist)."""
    return write_model_site(tmp_path_factory.mktemp("sglang-model-site"))
