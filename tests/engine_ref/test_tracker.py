"""ActivationTracker, the one activation-peak tracker of both targets (engine_ref's profile run and
``targets.vllm.engine.memory.activation_peak``): a storage counts until its last reference dies."""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import pytest
import torch

from engine_ref.memory.tracker import ActivationTracker
from pytest_enginecheck.targets.vllm.engine.memory import activation_peak

MiB = 1 << 20
MODES: dict[str, Callable[[], contextlib.AbstractContextManager]] = {
    "inference_mode": torch.inference_mode, "no_grad": torch.no_grad, "grad": contextlib.nullcontext}


def _view_then_free() -> None:
    """A 4 MiB buffer is viewed and the original freed; a second 4 MiB buffer is allocated while the view lives."""
    buffer = torch.empty(MiB, dtype=torch.float32)
    view = buffer.view(2, -1)
    del buffer
    second = torch.empty(MiB, dtype=torch.float32)
    del view, second


def _one_after_the_other() -> None:
    for _ in range(3):
        buffer = torch.empty(MiB, dtype=torch.float32)
        del buffer


@pytest.mark.parametrize("mode", MODES)
def test_a_view_keeps_its_storage_counted_after_the_original_dies(mode: str) -> None:
    with MODES[mode]():
        with ActivationTracker() as tracker:
            _view_then_free()
        assert (tracker.peak_bytes, tracker.current_bytes) == (8 * MiB, 0)
        assert activation_peak(_view_then_free) == 8 * MiB  # the vLLM target measures with the same tracker


@pytest.mark.parametrize("mode", MODES)
def test_a_freed_storage_stops_counting(mode: str) -> None:
    with MODES[mode]():
        assert activation_peak(_one_after_the_other) == 4 * MiB


def test_existing_storages_and_their_views_are_not_counted() -> None:
    weight = torch.ones(MiB, dtype=torch.float32)

    def forward() -> None:
        transposed = weight.view(1024, 1024).t()
        out = transposed.sum(dim=0)
        del transposed, out

    with torch.inference_mode():
        assert activation_peak(forward, [weight]) == 1024 * 4
        assert activation_peak(forward) == 4 * MiB + 1024 * 4  # not told: the weight's view counts as new
