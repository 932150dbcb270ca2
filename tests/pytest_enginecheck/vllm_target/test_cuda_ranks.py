"""--enginecheck-strict in vLLM's ranks without vLLM (engine/cuda_ranks.py): which frames are the model's, which
vLLM phase an access falls in, and one rank's guard over code laid out as a rank runs it (a vLLM worker function
calling the model's code, vLLM's own code asking torch.cuda beside it). The engine itself: tests/vllm/
test_vllm_strict.py."""

from __future__ import annotations

import os
import sys
from types import FrameType
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from pytest_enginecheck.targets.vllm.engine import cuda_ranks  # noqa: E402
from pytest_enginecheck.targets.vllm.engine.cuda_ranks import (  # noqa: E402
    GUARD_VARIABLE,
    ModelCode,
    RankCudaFailure,
    RankGuard,
    guarded_ranks,
    rank_guard,
    stage_of,
)

VLLM_FILE = os.path.join(os.path.dirname(os.__file__), "site-packages", "vllm", "v1", "worker", "cpu_model_runner.py")
PLUGIN_FILE = "/plugins/site/ectp/models/strict_cuda.py"  # the author's code on the path, outside every library


def _module(name: str, file: str, source: str) -> dict[str, Any]:
    """The namespace of a module ``name`` whose functions' frames say ``file``: code laid out as a rank runs it."""
    namespace: dict[str, Any] = {"__name__": name, "torch": torch, "sys": sys}
    exec(compile(source, file, "exec"), namespace)
    return namespace


def _frame(name: str, file: str) -> FrameType:
    frame: FrameType = _module(name, file, "def here():\n    return sys._getframe()\n")["here"]()
    return frame


@pytest.mark.parametrize(("model", "name", "file", "is_model"), [
    ("ectp.models.strict_cuda", "ectp.models.strict_cuda", PLUGIN_FILE, True),  # the class's module
    ("ectp.models.strict_cuda", "ectp.kernels", "/site-packages/ectp/kernels.py", True),  # its package, installed
    ("ectp.models.strict_cuda", "author_helpers", "/home/author/src/author_helpers.py", True),  # outside libraries
    ("ectp.models.strict_cuda", "vllm.platforms.cpu", VLLM_FILE, False),
    ("ectp.models.strict_cuda", "torch.cuda", torch.cuda.__file__, False),
    ("ectp.models.strict_cuda", "contextlib", os.path.join(os.path.dirname(os.__file__), "contextlib.py"), False),
    ("ectp.models.strict_cuda", "dataclass_init", "<string>", False),
    ("ectp.models.strict_cuda", "pytest_enginecheck.guard", cuda_ranks.__file__, False),
    # code torch.compile generated (vLLM's sampler compiles on CPU too): outside every library, yet not the author's
    ("ectp.models.strict_cuda", "torch_generated", "/tmp/torchinductor_root/q6/cq6wrapper.py", False),
    # vLLM's own model: its module is the model's code, the rest of vLLM is not
    ("vllm.model_executor.models.llama", "vllm.model_executor.models.llama", VLLM_FILE, True),
    ("vllm.model_executor.models.llama", "vllm.model_executor.layers.linear", VLLM_FILE, False),
])
def test_the_models_code_is_its_module_its_package_and_the_authors_files(model: str, name: str, file: str,
                                                                         is_model: bool) -> None:
    assert ModelCode(model)(_frame(name, file)) is is_model


RANK = '''\
def load_model(model):
    return model()


def determine_available_memory(model):
    return profile_run(model)


def profile_run(model):
    return model()


def execute_model(model):
    return model()


def vllms_own_query():
    return torch.cuda.is_available()
'''


def test_the_stage_is_vllms_innermost_worker_function_on_the_stack() -> None:
    rank = _module("vllm.v1.worker.cpu_model_runner", VLLM_FILE, RANK)
    here = sys._getframe
    assert stage_of(rank["load_model"](here)) == ("build", "load_model")
    assert stage_of(rank["execute_model"](here)) == ("forward", "execute_model")
    assert stage_of(rank["determine_available_memory"](here)) == ("forward", "profile_run")
    assert stage_of(here()) == cuda_ranks.OUTSIDE
    outside_vllm = _module("ectp.models.strict_cuda", PLUGIN_FILE, RANK)  # a model's own load_model is no phase
    assert stage_of(outside_vllm["load_model"](here)) == cuda_ranks.OUTSIDE


@pytest.fixture
def nvml_queries(monkeypatch: pytest.MonkeyPatch) -> None:
    """On a GPU host, let is_available() ask NVML instead of running cuInit here."""
    monkeypatch.setenv("PYTORCH_NVML_BASED_CUDA_CHECK", "1")


@pytest.mark.usefixtures("nvml_queries")
def test_a_ranks_guard_fails_the_models_query_with_rank_phase_file_and_line_and_lets_vllms_through() -> None:
    rank = _module("vllm.v1.worker.cpu_model_runner", VLLM_FILE, RANK)
    model = _module("ectp.models.strict_cuda", PLUGIN_FILE, "def forward():\n    return torch.cuda.is_available()\n")
    answer = torch.cuda.is_available()
    with RankGuard("ectp.models.strict_cuda", 1, 2) as guard:
        assert rank["vllms_own_query"]() == answer  # vLLM's own query: answered, as unguarded
        assert rank["execute_model"](rank["vllms_own_query"]) == answer  # vLLM's, though the model's forward runs
        with pytest.raises(Exception, match="CUDA touched while the enginecheck CUDA guard is on"):
            rank["execute_model"](model["forward"])
    failure = guard.failure()
    assert isinstance(failure, RankCudaFailure)
    assert (failure.rank, failure.world_size, failure.stage, failure.phase) == (1, 2, "forward", "execute_model")
    access = failure.cuda_access
    assert (access.api, access.kind, access.file, access.line) == ("torch.cuda.is_available", "query", PLUGIN_FILE, 2)
    assert failure.exception.startswith("CudaAccessError: rank 1 of 2 queries CUDA in forward (vLLM's "
                                        "execute_model): called torch.cuda.is_available() at "
                                        f"{PLUGIN_FILE}:2"), failure.exception
    assert not failure.traceback  # the check's cause is then its kind (checks.causes), on every rank and TP size


@pytest.mark.usefixtures("nvml_queries")
def test_a_clean_ranks_guard_has_no_failure() -> None:
    rank = _module("vllm.v1.worker.cpu_model_runner", VLLM_FILE, RANK)
    with RankGuard("ectp.models.strict_cuda", 0, 1) as guard:
        rank["execute_model"](rank["vllms_own_query"])
    assert guard.failure() is None


def test_without_strict_no_variable_is_set_and_a_rank_runs_unguarded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(GUARD_VARIABLE, raising=False)
    with guarded_ranks(""):
        assert GUARD_VARIABLE not in os.environ and rank_guard(0, 1) is None
    with guarded_ranks("ectp.models.strict_cuda"):
        guard = rank_guard(1, 2)
        assert guard is not None and guard.is_model.module == "ectp.models.strict_cuda"
    assert GUARD_VARIABLE not in os.environ
