"""CudaGuard, in this process: every way torch initializes CUDA is caught, recorded where it happened,
and torch is put back exactly as it was.

No test here lets a CUDA call through to the real torch: on a GPU host that would initialize CUDA
in the test process and break the forks of later tests.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from pytest_enginecheck.guard import FIX_HINTS, CudaAccessError, CudaGuard  # noqa: E402

# Each call sits alone on its line, so the line the guard records is the lambda's first line.
CUDA_CALLS: dict[str, Callable[[], Any]] = {
    "torch.zeros":
        lambda: torch.zeros(2, device="cuda"),
    "torch.empty":
        lambda: torch.empty(2, device=torch.device("cuda", 0)),
    "torch.tensor":
        lambda: torch.tensor([1.0, 2.0], device="cuda:0"),
    "Tensor.cuda":
        lambda: torch.ones(2).cuda(),
    "Tensor.to":
        lambda: torch.ones(2).to("cuda"),
    "torch.cuda.get_device_properties":
        lambda: torch.cuda.get_device_properties(0),
    "torch.cuda.get_device_capability":
        lambda: torch.cuda.get_device_capability(),
    "torch.cuda.current_device":
        lambda: torch.cuda.current_device(),
    "torch.cuda.mem_get_info":
        lambda: torch.cuda.mem_get_info(),
    "torch.cuda.synchronize":
        lambda: torch.cuda.synchronize(),
    "torch.cuda.set_device":
        lambda: torch.cuda.set_device(0),
    "torch.cuda.Stream":
        lambda: torch.cuda.Stream(),
    "torch.cuda.Event":
        lambda: torch.cuda.Event(),
    "torch.cuda.device":
        lambda: torch.cuda.device(0).__enter__(),
    "torch.cuda.get_rng_state":
        lambda: torch.cuda.get_rng_state(),
    "torch.cuda.reset_peak_memory_stats":
        lambda: torch.cuda.reset_peak_memory_stats(),
    "torch.Tensor.pin_memory":
        lambda: torch.ones(2).pin_memory(),
}
# Names the guard replaces, in torch.cuda and in every torch module holding its own reference.
PATCHED_NAMES = ("_lazy_init", "set_device", "stream", "Stream", "Event", "device", "get_rng_state",
                 "reset_peak_memory_stats", "is_available", "device_count")


@pytest.fixture
def nvml_queries(monkeypatch: pytest.MonkeyPatch) -> None:
    """On a GPU host, let is_available()/device_count() ask NVML instead of running cuInit here."""
    monkeypatch.setenv("PYTORCH_NVML_BASED_CUDA_CHECK", "1")


def torch_state() -> dict[tuple[str, str], Any]:
    """Every patchable attribute of every loaded torch module, plus Tensor.pin_memory."""
    state: dict[tuple[str, str], Any] = {("torch.Tensor", "pin_memory"): torch.Tensor.pin_memory}
    for module_name, module in list(sys.modules.items()):
        if module_name.startswith("torch") and module is not None:
            for name in PATCHED_NAMES:
                if name in vars(module):
                    state[(module_name, name)] = vars(module)[name]
    return state


@pytest.mark.parametrize("api", list(CUDA_CALLS))
def test_each_cuda_api_is_caught_and_recorded_where_it_was_called(api: str) -> None:
    call = CUDA_CALLS[api]
    with CudaGuard() as guard, pytest.raises(CudaAccessError) as excinfo:
        call()
    assert len(guard.accesses) == 1, [a.api for a in guard.accesses]
    access = guard.accesses[0]
    assert (access.api, access.kind) == (api, "init")
    assert (access.file, access.line) == (__file__, call.__code__.co_firstlineno)
    assert access.code is not None and access.code.startswith("lambda: torch.")
    assert access.chain == []  # nothing was being imported
    assert excinfo.value.access is access
    assert f"{api} at {__file__}:{access.line}" in str(excinfo.value)


def test_a_module_built_with_cuda_is_caught_at_the_line_that_moves_it() -> None:
    with CudaGuard() as guard:
        with pytest.raises(CudaAccessError):
            torch.nn.Linear(2, 2).cuda()
        line = sys._getframe().f_lineno - 1
    assert [(a.file, a.line) for a in guard.accesses] == [(__file__, line)]
    assert "cuda" in guard.accesses[0].api


def test_an_import_chain_is_recorded_from_the_outer_module_to_the_offender(tmp_path: Path,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "guardchain_top.py").write_text("import guardchain_mid\n")
    (tmp_path / "guardchain_mid.py").write_text("import guardchain_leaf\n")
    (tmp_path / "guardchain_leaf.py").write_text("import torch\n\nWORKSPACE = torch.zeros(4, device='cuda')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        with CudaGuard() as guard, pytest.raises(CudaAccessError):
            import guardchain_top  # noqa: F401
    finally:
        for name in ("guardchain_top", "guardchain_mid", "guardchain_leaf"):
            sys.modules.pop(name, None)
    access = guard.first_access
    assert access is not None
    assert (access.api, access.file, access.line) == ("torch.zeros", str(tmp_path / "guardchain_leaf.py"), 3)
    # Only modules being imported: not pytest's __main__, nor xdist's exec'd "__channelexec__".
    assert access.chain == ["guardchain_top", "guardchain_mid", "guardchain_leaf"]
    assert "Import chain: " in access.describe() and "guardchain_top -> guardchain_mid -> guardchain_leaf" in \
        access.describe()


def test_a_swallowed_cuda_error_is_still_recorded() -> None:
    with CudaGuard() as guard:
        try:
            torch.zeros(1, device="cuda")
        except Exception:  # noqa: BLE001 - the code under test falls back to CPU on any error
            fallback = torch.zeros(1)
        line = sys._getframe().f_lineno - 3
    assert fallback.device.type == "cpu"
    assert [(a.api, a.line) for a in guard.accesses] == [("torch.zeros", line)]
    assert guard.first_access is guard.accesses[0]


def test_every_access_is_recorded_in_order() -> None:
    with CudaGuard() as guard:
        for call in (CUDA_CALLS["torch.cuda.set_device"], CUDA_CALLS["Tensor.cuda"], CUDA_CALLS["torch.cuda.Stream"]):
            with pytest.raises(CudaAccessError):
                call()
    assert [a.api for a in guard.accesses] == ["torch.cuda.set_device", "Tensor.cuda", "torch.cuda.Stream"]


def test_device_objects_and_cpu_work_touch_nothing() -> None:
    with CudaGuard(strict=True) as guard:
        devices = [torch.device("cuda"), torch.device("cuda", 1), torch.device("cuda:0")]
        on_meta = torch.empty(1024, 1024, device="meta")
        on_cpu = torch.ones(3).to("cpu") * 2
        torch.cuda.device(0)  # constructing it selects nothing; entering it would
    assert guard.accesses == []
    assert [d.type for d in devices] == ["cuda"] * 3
    assert (on_meta.device.type, on_cpu.tolist()) == ("meta", [2.0, 2.0, 2.0])


@pytest.mark.usefixtures("nvml_queries")
def test_strict_mode_records_cuda_queries_without_raising() -> None:
    with CudaGuard(strict=True) as guard:
        available = torch.cuda.is_available()
        count = torch.cuda.device_count()
        line = sys._getframe().f_lineno - 2
    assert isinstance(available, bool) and isinstance(count, int)
    assert [(a.api, a.kind, a.file, a.line) for a in guard.accesses] == [
        ("torch.cuda.is_available", "query", __file__, line),
        ("torch.cuda.device_count", "query", __file__, line + 1),
    ]
    assert "torch.cuda.is_available()" in guard.accesses[0].describe()
    assert "PYTORCH_NVML_BASED_CUDA_CHECK=1" in guard.accesses[0].fix_hint


# The form FIX_HINTS["init"] suggests: the CUDA call moved into a function that runs with the model (cached), the
# device taken from the input; and the form it used to suggest, a guard that asks CUDA at import.
SUGGESTED = """import functools

import torch


@functools.cache
def workspace(device: torch.device) -> torch.Tensor:
    return torch.zeros(4, device=device)


class Layer(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + workspace(x.device)
"""
GUARDED = """import torch

WORKSPACE = torch.zeros(4, device="cuda") if torch.cuda.is_available() else torch.zeros(4)
"""


@pytest.mark.usefixtures("nvml_queries")
def test_the_fix_the_hint_suggests_passes_strict_mode(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """What FIX_HINTS["init"] tells an author to write imports and runs under a strict guard without a CUDA call;
    the `is_available()` guard it no longer suggests is a query at import, which strict mode fails."""
    assert "functools.cache" in FIX_HINTS["init"] and ".device" in FIX_HINTS["init"]
    assert "--enginecheck-strict fails" in FIX_HINTS["init"]  # names the guard as what not to write
    (tmp_path / "suggested_form.py").write_text(SUGGESTED)
    (tmp_path / "guarded_form.py").write_text(GUARDED)
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        with CudaGuard(strict=True) as guard:
            suggested = __import__("suggested_form")
            assert suggested.Layer()(torch.ones(4)).tolist() == [1.0] * 4
        assert guard.accesses == []
        with CudaGuard(strict=True) as guard:
            __import__("guarded_form")
    finally:
        for name in ("suggested_form", "guarded_form"):
            sys.modules.pop(name, None)
    assert [(a.api, a.kind) for a in guard.accesses] == [("torch.cuda.is_available", "query")]
    assert "functools.cache" in guard.accesses[0].fix_hint and ".device" in guard.accesses[0].fix_hint


@pytest.mark.usefixtures("nvml_queries")
def test_without_strict_mode_cuda_queries_are_not_recorded() -> None:
    with CudaGuard() as guard:
        torch.cuda.is_available()
        torch.cuda.device_count()
    assert guard.accesses == []


@pytest.fixture
def state_before() -> Iterator[dict[tuple[str, str], Any]]:
    import torch.cuda.memory
    import torch.cuda.random  # noqa: F401

    yield torch_state()


@pytest.mark.parametrize("strict", [False, True], ids=["default", "strict"])
def test_torch_is_restored_exactly_on_exit(state_before: dict[tuple[str, str], Any], strict: bool) -> None:
    originals = (torch.cuda._lazy_init, torch.cuda.Stream, torch.cuda.Event, torch.cuda.set_device,
                 torch.Tensor.pin_memory, torch.cuda.is_available, torch.cuda.device_count)
    with CudaGuard(strict=strict):
        patched = torch_state()
        assert torch.cuda._lazy_init is not originals[0]
        assert torch.cuda.random._lazy_init is torch.cuda._lazy_init  # a submodule's own reference, replaced too
        assert torch.Tensor.pin_memory is not originals[4]
        assert (torch.cuda.is_available is not originals[5]) == strict
    assert (torch.cuda._lazy_init, torch.cuda.Stream, torch.cuda.Event, torch.cuda.set_device,
            torch.Tensor.pin_memory, torch.cuda.is_available, torch.cuda.device_count) == originals
    assert sum(patched[k] is not v for k, v in state_before.items()) >= 5
    after = torch_state()
    assert after.keys() == state_before.keys()
    assert [k for k, v in state_before.items() if after[k] is not v] == []
    # Nothing added either: torch.ops and torch.classes make a namespace for any name asked of them.
    assert set(PATCHED_NAMES) & (set(vars(torch.ops)) | set(vars(torch.classes))) == set()


def test_torch_is_restored_when_the_body_raises(state_before: dict[tuple[str, str], Any]) -> None:
    with pytest.raises(CudaAccessError), CudaGuard():
        torch.cuda.current_device()
    after = torch_state()
    assert [k for k, v in state_before.items() if after[k] is not v] == []


def _the_models_code() -> Any:
    return torch.cuda._lazy_init()


def _the_engines_code() -> Any:
    return torch.cuda._lazy_init()


def _the_models_query() -> bool:
    return bool(torch.cuda.is_available())


def _the_engines_query() -> bool:
    return bool(torch.cuda.is_available())


@pytest.mark.usefixtures("nvml_queries")
def test_a_guard_with_blames_refuses_only_the_blamed_callers_access_and_lets_the_others_through(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The model's code in an engine's rank (``blames``): its touch and its query are recorded and refused, the
    engine's run torch's own functions as if no guard were on (here a stand-in for _lazy_init: no CUDA call reaches
    the real torch), and the preload's import hook stays off."""
    import builtins

    reached: list[str] = []
    monkeypatch.setattr(torch.cuda, "_lazy_init", lambda: reached.append("torch's _lazy_init"))
    models = {_the_models_code.__code__, _the_models_query.__code__}
    before_import, answer = builtins.__import__, torch.cuda.is_available()
    with CudaGuard(strict=True, blames=lambda frame: frame.f_code in models) as guard:
        assert builtins.__import__ is before_import
        _the_engines_code()
        assert _the_engines_query() == answer
        with pytest.raises(CudaAccessError):
            _the_models_code()
        with pytest.raises(CudaAccessError):
            _the_models_query()
    assert reached == ["torch's _lazy_init"]
    assert [(a.api, a.kind, a.line) for a in guard.accesses] == [
        ("torch.cuda._lazy_init", "init", _the_models_code.__code__.co_firstlineno + 1),
        ("torch.cuda.is_available", "query", _the_models_query.__code__.co_firstlineno + 1)]
