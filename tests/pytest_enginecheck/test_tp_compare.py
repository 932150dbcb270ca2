"""The comparison both targets' TP diagnoses share (``pytest_enginecheck.tp_compare``): call keys, the tensor a
hook reads, float32 closeness and rank outputs split along one dimension put back together."""

from __future__ import annotations

import math

import pytest
import torch

from pytest_enginecheck.tp_compare import CallKeys, close, first_tensor, join_split, max_abs_diff, module_name


def test_call_keys_number_a_shared_modules_later_calls_and_track_the_innermost() -> None:
    keys = CallKeys()
    assert keys.innermost is None
    assert keys.enter("model.layers.0") == "model.layers.0"
    assert keys.enter("model.rotary") == "model.rotary"
    assert keys.leave() == "model.rotary"
    assert keys.enter("model.rotary") == "model.rotary (call 2)"
    assert keys.innermost == "model.rotary (call 2)"
    assert [keys.leave(), keys.leave()] == ["model.rotary (call 2)", "model.layers.0"]
    assert module_name("model.rotary (call 2)") == module_name("model.rotary") == "model.rotary"


def test_first_tensor_of_a_hooks_argument() -> None:
    t = torch.ones(2)
    assert first_tensor(t) is t
    assert first_tensor((None, 3, t, torch.zeros(1))) is t
    assert first_tensor({"x": t}) is None and first_tensor(()) is None


def test_close_and_max_abs_diff_in_float32() -> None:
    a = torch.tensor([1.0, float("nan")])
    assert close(a + 5e-5, a) and not close(a + 1e-2, a)
    assert not close(None, a) and not close(torch.ones(3), torch.ones(2))
    assert close(torch.ones(2), torch.ones(2) + 0.5, atol=1.0) and not close(torch.ones(2), torch.ones(2) + 1e-6,
                                                                             atol=0.0, rtol=0.0)
    assert max_abs_diff(torch.tensor([1.0, 2.0]), torch.tensor([1.5, 4.0])) == 2.0
    assert math.isinf(max_abs_diff(torch.tensor([float("nan")]), torch.tensor([1.0])))
    assert max_abs_diff(torch.ones(0), torch.ones(0)) == 0.0


@pytest.mark.parametrize("dim", [0, 1])
def test_join_split_joins_parts_along_their_one_short_dimension(dim: int) -> None:
    full = torch.arange(24.0).reshape(4, 6)
    joined = join_split(full, list(full.chunk(2, dim=dim)))
    assert joined is not None and joined[1] == dim and torch.equal(joined[0], full)


def test_join_split_refuses_parts_that_are_not_one_split() -> None:
    full = torch.zeros(4, 6)
    assert join_split(full, [torch.zeros(2, 3), torch.zeros(2, 3)]) is None  # two short dimensions
    assert join_split(full, [torch.zeros(4, 2), torch.zeros(4, 2)]) is None  # widths do not add up
    assert join_split(full, [torch.zeros(24), torch.zeros(24)]) is None  # another number of dimensions
