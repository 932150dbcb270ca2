"""Root conftest: pytester for the plugin's own tests, and a private ModelInfo cache per session."""

import os

import pytest

pytest_plugins = ["pytester"]


@pytest.fixture(scope="session", autouse=True)
def _private_engine_ref_cache(tmp_path_factory: pytest.TempPathFactory) -> None:
    """Keep the tests' ModelInfo cache out of the user's ~/.cache (children inherit the variable)."""
    if "ENGINE_REF_CACHE_ROOT" not in os.environ:
        os.environ["ENGINE_REF_CACHE_ROOT"] = str(tmp_path_factory.mktemp("engine_ref_cache"))
