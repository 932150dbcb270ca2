"""engine_ref's own CUDA guard (engine_ref.worker.cuda_guard), in this process: under ENGINE_REF_CUDA_GUARD=strict a
rank's build or forward that touches or queries CUDA raises CudaGuardError naming the rank, the call, the file and
the line (a swallowed touch too), torch is put back exactly, and without the variable the worker has no guard.

No test here lets a CUDA call through to the real torch, except the queries (answered through NVML on a GPU host).
Every rank process and TP size, end to end: tests/pytest_enginecheck/test_strict_ranks.py.
"""

from __future__ import annotations

import contextlib
import pickle
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from engine_ref import envs
from engine_ref.config import DeviceConfig
from engine_ref.engine.arg_utils import EngineArgs
from engine_ref.errors import ConfigError
from engine_ref.worker.cuda_guard import CudaGuardError, WorkerCudaGuard, worker_cuda_guard
from tests.helpers import LLAMA

HERE = Path(__file__).name


@pytest.fixture(autouse=True)
def nvml_queries(monkeypatch: pytest.MonkeyPatch) -> None:
    """On a GPU host, let is_available()/device_count() ask NVML instead of running cuInit here."""
    monkeypatch.setenv("PYTORCH_NVML_BASED_CUDA_CHECK", "1")


def _run(phase: str, body: Callable[[], Any]) -> CudaGuardError:
    with pytest.raises(CudaGuardError) as raised, WorkerCudaGuard(1, 2).phase(phase):
        body()
    return raised.value


def _line_of(text: str) -> int:
    """The line of this file that holds ``text``."""
    return next(i for i, line in enumerate(Path(__file__).read_text().splitlines(), 1) if text in line)


def test_a_query_in_a_build_names_the_rank_the_call_the_file_and_the_line() -> None:
    error = _run("load_model", lambda: torch.cuda.is_available())  # the query
    assert (error.rank, error.world_size, error.phase, error.stage, error.api, error.access) == \
        (1, 2, "load_model", "build", "torch.cuda.is_available", "query")
    assert (Path(error.file or "").name, error.line) == (HERE, _line_of("torch.cuda.is_available())  # the query"))
    assert str(error).startswith(f"rank 1 of 2 queries CUDA in build (load_model): torch.cuda.is_available() at "
                                 f"tests/engine_ref/{HERE}:{error.line} (`error = _run(")
    assert "unset ENGINE_REF_CUDA_GUARD" in str(error)


def test_dot_cuda_in_a_forward_is_a_touch_not_the_cpu_builds_assertion() -> None:
    error = _run("execute_model", lambda: torch.ones(2).cuda())  # the touch
    assert (error.stage, error.api, error.access, error.line) == \
        ("forward", "Tensor.cuda", "init", _line_of("torch.ones(2).cuda())  # the touch"))
    assert str(error).startswith("rank 1 of 2 touches CUDA in forward (execute_model): Tensor.cuda at ")


def test_a_swallowed_touch_still_fails_the_phase() -> None:
    def swallows() -> None:
        with contextlib.suppress(Exception):  # what a model that tries the GPU first does
            torch.cuda.get_device_properties(0)

    error = _run("profile_run", swallows)
    assert (error.api, error.access, error.line) == ("torch.cuda.get_device_properties", "init",
                                                      _line_of("torch.cuda.get_device_properties(0)"))


def test_the_error_travels_to_the_driver_whole() -> None:
    error = _run("load_model", lambda: torch.cuda.device_count())
    again = pickle.loads(pickle.dumps(error))
    assert (type(again), str(again), again.rank, again.line, again.code) == \
        (CudaGuardError, str(error), 1, error.line, error.code)


def _torch_state() -> dict[tuple[str, str], Any]:
    """Every attribute the guard replaces, in every loaded torch module that has it, and Tensor.pin_memory."""
    names = ("_lazy_init", "is_available", "device_count", "set_device", "Stream", "Event", "device")
    state: dict[tuple[str, str], Any] = {("torch.Tensor", "pin_memory"): torch.Tensor.pin_memory}
    for module_name, module in list(sys.modules.items()):
        if module_name.startswith("torch") and module is not None:
            state.update({(module_name, name): vars(module)[name] for name in names if name in vars(module)})
    return state


def test_a_model_that_takes_its_device_from_its_parameters_passes_and_torch_is_put_back() -> None:
    before = _torch_state()
    layer = torch.nn.Linear(4, 4)
    with WorkerCudaGuard(0, 1).phase("execute_model"):
        assert torch.cuda.is_available is not before[("torch.cuda", "is_available")]  # the guard is on
        layer(torch.ones(2, 4, device=layer.weight.device)).to(layer.weight.device)
    assert _torch_state() == before


def test_a_gpu_engine_is_refused_by_name(monkeypatch: pytest.MonkeyPatch,
                                         tiny_checkpoint: Callable[..., Path]) -> None:
    """What a GPU host's engine would meet (a CPU torch refuses device='cuda' before any worker starts)."""
    config = EngineArgs(model=str(tiny_checkpoint(LLAMA)), device_memory="64MiB").create_engine_config()
    monkeypatch.setenv(envs.CUDA_GUARD_VARIABLE, "strict")
    assert isinstance(worker_cuda_guard(config, 0), WorkerCudaGuard)
    config.device_config = DeviceConfig(device="cuda")
    with pytest.raises(ConfigError, match=r"ENGINE_REF_CUDA_GUARD=strict checks that a CPU engine's model never "
                                          r"touches CUDA, but this engine runs on device='cuda'; use device='cpu'"):
        worker_cuda_guard(config, 0)


def test_without_the_variable_a_worker_has_no_guard(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(envs.CUDA_GUARD_VARIABLE, raising=False)
    assert envs.cuda_guard() is None
    monkeypatch.setenv(envs.CUDA_GUARD_VARIABLE, "")
    assert envs.cuda_guard() is None


@pytest.mark.parametrize("value", ["1", "on", "STRICT"])
def test_an_unknown_value_names_itself_and_the_fix(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    monkeypatch.setenv(envs.CUDA_GUARD_VARIABLE, value)
    with pytest.raises(ConfigError, match=rf"ENGINE_REF_CUDA_GUARD={value!r} is unknown; set it to 'strict'"):
        envs.cuda_guard()
