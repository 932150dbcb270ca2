"""The vLLM target's checks without vLLM: TP verification, the log-probability comparison and when it is skipped,
and the import and inspect checks in one fork over a fake registry."""

from __future__ import annotations

import importlib
import os
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from pytest_enginecheck.checks import CheckContext, CheckSkip
from pytest_enginecheck.settings import Settings
from tests.pytest_enginecheck.vllm_target.helpers import _ckpt

# --- checks: TP verification and the log-probability comparison -----------------------------------------------

def test_verify_tp_skips_a_size_the_heads_cannot_be_split_over(tmp_path: Path) -> None:
    from pytest_enginecheck.targets.vllm.checks.steps import fits, verify_tp

    ckpt = _ckpt(tmp_path, num_attention_heads=6)
    verify_tp(ckpt, 2)
    verify_tp(ckpt, 3)
    with pytest.raises(CheckSkip, match="num_attention_heads=6 cannot be split over tensor_parallel_size=4"):
        verify_tp(ckpt, 4)
    assert [fits(ckpt, tp) for tp in (1, 2, 4, 6)] == [True, True, False, True]


def test_logprob_difference_is_the_worst_token_both_runs_report_and_where() -> None:
    from pytest_enginecheck.targets.vllm.checks.load import logprob_difference

    reference = [[{"5": -1.0, "7": -2.0}, {"3": -0.5}], [{"1": -0.1}]]
    run = [[{"5": -1.0, "9": -3.0}, {"3": -0.5}], [{"1": -0.1004, "2": -9.0}]]
    difference, prompt, position = logprob_difference(run, reference)
    assert (prompt, position) == (1, 1)  # position 0 predicts nothing: positions count from 1
    assert difference == pytest.approx(4e-4)
    assert logprob_difference(reference, reference) == (0.0, 0, 0)
    with pytest.raises(ValueError):  # a run with other positions than its reference is not comparable
        logprob_difference([[{"5": -1.0}]], reference)


def test_the_tp_comparison_is_skipped_only_off_float32_and_says_why() -> None:
    from pytest_enginecheck.targets.vllm.checks.load import tp_comparison_skipped

    assert tp_comparison_skipped("LlamaForCausalLM", 2, "float32") is None
    reason = tp_comparison_skipped("DeepseekV2ForCausalLM", 2, "bfloat16")
    assert reason is not None
    assert "built, loaded and generated at tensor_parallel_size=2 (bfloat16)" in reason
    assert "derived for float32" in reason and "MLA" in reason and "amx_mla.py" in reason


# --- import + inspect in one fork: the import check leaves the inspect verdict, the inspect check uses it -----------

FAKE_REGISTRY = {
    "vllm/plugins/__init__.py": "DEFAULT_PLUGINS_GROUP = 'vllm.general_plugins'\n\n\n"
                                "def load_general_plugins():\n    pass\n",
    "vllm/model_executor/models/__init__.py": "",
    "vllm/model_executor/models/registry.py": '''\
from dataclasses import dataclass


@dataclass
class _LazyRegisteredModel:
    module_name: str
    class_name: str


@dataclass
class _ModelInfo:
    architecture: str
    is_text_generation_model: bool

    @staticmethod
    def from_model_cls(model_cls):
        if model_cls.__name__.startswith("Bad"):
            raise ValueError(f"{model_cls.__name__} declares no rope_theta")
        return _ModelInfo(model_cls.__name__, True)


class _Registry:
    models = {name: _LazyRegisteredModel("vllm.model_executor.models.toy", name)
              for name in ("ToyForCausalLM", "BadForCausalLM")}


ModelRegistry = _Registry()
''',
    "vllm/model_executor/models/toy.py": "class ToyForCausalLM:\n    pass\n\n\nclass BadForCausalLM:\n    pass\n",
}


def _verdict(check: str, architecture: str, workdir: Path, inspect_mode: str = "fork") -> Any:
    from pytest_enginecheck.checks.runner import run_in_child

    ctx = CheckContext(check=check, spec="vllm", architecture=architecture, module="vllm.model_executor.models.toy",
                       class_name=architecture, workdir=str(workdir),
                       options=Settings(target_options=(("inspect", inspect_mode),)))
    result = run_in_child(ctx)
    return result.outcome, result.message, {k: v for k, v in result.detail.items() if k not in ("cached",)}


@pytest.fixture
def fake_registry(fake_vllm: Any, monkeypatch: pytest.MonkeyPatch) -> Path:
    from pytest_enginecheck.targets.vllm.describe import plugins

    monkeypatch.setattr(plugins, "_loaded", None)
    return Path(fake_vllm(FAKE_REGISTRY))


def test_inspect_uses_the_verdict_the_import_check_built_and_imports_by_itself_without_one(
        fake_registry: Path, tmp_path: Path) -> None:
    from pytest_enginecheck.targets.vllm.checks.inspect_check import inspection_path

    shared, alone = tmp_path / "session", tmp_path / "alone"
    assert _verdict("import", "ToyForCausalLM", shared)[0] == "passed"
    assert os.path.exists(inspection_path(CheckContext("inspect", "vllm", "ToyForCausalLM", "", "", str(shared))))
    by_itself = _verdict("inspect", "ToyForCausalLM", alone)  # run alone (-k, another worker or shard)
    assert by_itself[0] == "passed" and by_itself[2]["architecture"] == "ToyForCausalLM"
    # The model's module gone: only a check that does not import it again still passes.
    (fake_registry / "vllm/model_executor/models/toy.py").unlink()
    del sys.modules["vllm.model_executor.models.toy"]
    importlib.invalidate_caches()
    stored = _verdict("inspect", "ToyForCausalLM", shared)
    assert stored[:2] == by_itself[:2]
    assert stored[2] == {**by_itself[2], "built_by": "the import check's fork"}
    assert _verdict("inspect", "ToyForCausalLM", tmp_path / "fresh")[0] == "failed"


def test_an_inspection_failure_built_by_the_import_check_is_the_inspect_checks_own(fake_registry: Path,
                                                                                   tmp_path: Path) -> None:
    shared = tmp_path / "session"
    assert _verdict("import", "BadForCausalLM", shared)[0] == "passed"  # the import is clean; inspect is not
    stored = _verdict("inspect", "BadForCausalLM", shared)
    by_itself = _verdict("inspect", "BadForCausalLM", tmp_path / "alone")
    assert stored[0] == by_itself[0] == "failed"
    assert stored[1] == by_itself[1] == ("ValueError: BadForCausalLM declares no rope_theta (vLLM inspecting "
                                         "BadForCausalLM)")
    assert stored[2] == by_itself[2] and stored[2]["cause"] == "ValueError: BadForCausalLM declares no rope_theta"


def test_the_subprocess_inspection_is_never_built_by_the_import_check(fake_registry: Path, tmp_path: Path) -> None:
    from pytest_enginecheck.targets.vllm.checks.inspect_check import inspection_path

    assert _verdict("import", "ToyForCausalLM", tmp_path, inspect_mode="subprocess")[0] == "passed"
    assert not os.path.exists(inspection_path(CheckContext("inspect", "vllm", "ToyForCausalLM", "", "",
                                                           str(tmp_path))))


@pytest.mark.parametrize("fate", ["crash", "hang"])
def test_a_crash_or_hang_while_building_the_stored_verdict_never_becomes_the_imports(
        fake_registry: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fate: str) -> None:
    """The import check builds the inspect verdict in a fork of its own: vLLM's ModelInfo building that segfaults or
    hangs there stores nothing, the import passes, and the inspect check inspects by itself."""
    import signal

    from pytest_enginecheck.targets.vllm.checks import inspect_check

    def breaks(*args: Any) -> None:
        if fate == "crash":
            os.kill(os.getpid(), signal.SIGSEGV)
        time.sleep(60)

    monkeypatch.setattr(inspect_check, "_store_inspection", breaks)
    monkeypatch.setattr(inspect_check, "STORE_TIMEOUT_S", 0.5)
    start = time.monotonic()
    assert _verdict("import", "ToyForCausalLM", tmp_path)[0] == "passed"
    assert time.monotonic() - start < 30  # the hang was cut at STORE_TIMEOUT_S, not waited for
    assert not os.path.exists(inspect_check.inspection_path(CheckContext("inspect", "vllm", "ToyForCausalLM", "", "",
                                                                  str(tmp_path))))
