"""Root conftest: pytester for the plugin's own tests, and a private ModelInfo cache per session."""

import os

import pytest

pytest_plugins = ["pytester"]

# One intra-op thread per process, for this run and every process it starts (read when torch is imported, so set
# before any test module imports it): the suite runs two xdist workers, each starting engines of two ranks and
# nested pytest runs, on machines of two cores. With torch's default (a thread per core), a process's OpenMP team
# waits on threads the other processes hold the cores from: measured on 2 cores, `pytest -n 2` 301-324 s with
# the default, 248 s with one thread. Models here are tiny; no test depends on the thread count.
os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture(scope="session", autouse=True)
def _private_engine_ref_cache(tmp_path_factory: pytest.TempPathFactory) -> None:
    """Keep the tests' ModelInfo cache out of the user's ~/.cache (children inherit the variable)."""
    if "ENGINE_REF_CACHE_ROOT" not in os.environ:
        os.environ["ENGINE_REF_CACHE_ROOT"] = str(tmp_path_factory.mktemp("engine_ref_cache"))
