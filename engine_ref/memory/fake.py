"""Run the engine on FakeTensors: full-size shapes, no memory, and the few values control flow needs.

Under ``FakeTensorMode`` every tensor is a shape without data, so a full-size model is built and
run in seconds and allocates nothing. Models, though, sometimes branch on values: the mixture of
experts loops over ``ids.unique().tolist()`` and gathers ``torch.where(ids == expert)``, Llava
counts its image tokens with ``int(mask.sum())``, the model runner samples with ``.tolist()``. A
fake tensor cannot answer those, so ``KnownValuesMode`` keeps, beside each small integer or
boolean fake tensor, its real value, computed by running the same operator on real tensors:

- token ids, positions and offsets come from real Python data (``torch.tensor``) or factories
  (``torch.arange``), so they and everything computed from them alone are known exactly;
- integers chosen from floating-point activations (``topk`` indices, ``argmax``) cannot be known.
  They take the value they have when every row of the activations is equal, which is the case in
  the engine's profile run: every token of its batch is token 0, and since rotary embedding
  moves only queries and keys, attention gives every token the same output (a weighted mean of
  equal values); so every token has the same hidden state in every layer, every router sends
  every token to the same ``top_k`` experts, and every row's argmax is the same. Which experts
  does not matter for memory (they all have the same shapes), so they are experts ``0..k-1``.

An operator whose output shape or result needs a value that is not known raises FakeRunError.
"""

from __future__ import annotations

import os
import traceback
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch._ops import OpOverload
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    FakeTensor,
    FakeTensorMode,
    unset_fake_temporarily,
)
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves, tree_map
from torch.utils.weak import WeakIdKeyDictionary

from engine_ref.errors import EngineRefError

# Beyond this many elements a tensor's value is not kept (token-sized tensors are far smaller).
MAX_KNOWN_NUMEL = 1 << 24

aten = torch.ops.aten
_LIFTS = (aten.lift_fresh.default, aten.lift_fresh_copy.default)
_ROW_INDICES = (aten.topk.default,)  # (values, indices) of each row
_ROW_ARGMAX = (aten.argmax.default, aten.argmin.default)


class FakeRunError(EngineRefError):
    """A model's forward needs a value that a fake (shape-only) run does not have."""


def _caller() -> str:
    """' at file:line' of the innermost frame outside torch and this module: the model code that asked."""
    skip = (os.path.dirname(torch.__file__), __file__)
    for frame in reversed(traceback.extract_stack()):
        if not frame.filename.startswith(skip):
            return f" at {frame.filename}:{frame.lineno}" + (f" ({frame.line})" if frame.line else "")
    return ""


def _is_index_like(tensor: torch.Tensor) -> bool:
    return not (tensor.dtype.is_floating_point or tensor.dtype.is_complex)


class KnownValuesMode(TorchDispatchMode):
    """Keeps the real values of small integer and boolean fake tensors; answers data-dependent ops.

    Enter it inside ``fake_mode`` (see ``fake_tensors()``): it sees each operator first, lets the
    fake mode compute the output's shape, and computes the real value beside it when it can.
    """

    def __init__(self, fake_mode: FakeTensorMode) -> None:
        super().__init__()
        self.fake_mode = fake_mode
        self.values: WeakIdKeyDictionary = WeakIdKeyDictionary()

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return False  # as ActivationTracker's: no torch._dynamo import (~1 s) at the first operator

    def _value(self, x: Any) -> Any:
        return self.values[x] if isinstance(x, FakeTensor) else x

    def _all_known(self, args: Any) -> bool:
        return all(t in self.values for t in tree_leaves(args) if isinstance(t, FakeTensor))

    def _run_real(self, func: Any, args: tuple, kwargs: dict) -> Any:
        with unset_fake_temporarily():
            return func(*tree_map(self._value, args), **tree_map(self._value, kwargs))

    def _keep(self, fake: torch.Tensor, real: torch.Tensor) -> None:
        if _is_index_like(fake) and fake.numel() <= MAX_KNOWN_NUMEL:
            self.values[fake] = real

    def __torch_dispatch__(self, func: OpOverload, types: Sequence[type], args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        if func in _LIFTS:  # torch.tensor(python data): the real value is the argument
            out = func(*args, **kwargs)
            if _is_index_like(out) and out.numel() <= MAX_KNOWN_NUMEL:
                with unset_fake_temporarily():
                    self._keep(out, args[0].clone())
            return out
        try:
            out = func(*args, **kwargs)
        except (DynamicOutputShapeException, DataDependentOutputException) as e:
            return self._data_dependent(func, args, kwargs, e)
        known = self._all_known((args, kwargs))
        computed = False
        if not known and func in _ROW_INDICES:
            with unset_fake_temporarily():
                indices = torch.arange(out[1].shape[-1], dtype=out[1].dtype).expand(out[1].shape).clone()
            self._keep(out[1], indices)
        elif not known and func in _ROW_ARGMAX:
            with unset_fake_temporarily():
                self._keep(out, torch.zeros(out.shape, dtype=out.dtype))
        elif known:
            fakes = [t for t in tree_leaves(out) if isinstance(t, FakeTensor)]
            if fakes and all(_is_index_like(t) and t.numel() <= MAX_KNOWN_NUMEL for t in fakes):
                real = self._run_real(func, args, kwargs)
                for fake, value in zip(tree_leaves(out), tree_leaves(real), strict=True):
                    if isinstance(fake, FakeTensor):
                        self._keep(fake, value)
                computed = True
        if func._schema.is_mutable and not computed:  # written from unknown values: forget what was known
            for arg, schema_arg in zip(args, func._schema.arguments, strict=False):
                written = schema_arg.alias_info is not None and schema_arg.alias_info.is_write
                if written and isinstance(arg, FakeTensor):
                    self.values.pop(arg, None)
        return out

    def _data_dependent(self, func: Any, args: tuple, kwargs: dict, error: Exception) -> Any:
        """An op whose output shape or value depends on data: run it on the known real values."""
        if not self._all_known((args, kwargs)):
            raise FakeRunError(
                f"{func}{_caller()} needs the values of a tensor computed from floating-point activations, "
                f"which a fake (shape-only) run does not have. Make the model's control flow and shapes depend "
                f"only on token ids and positions, or teach engine_ref.memory.fake which value to assume."
            ) from error
        real = self._run_real(func, args, kwargs)

        def to_fake(value: Any) -> Any:
            if not isinstance(value, torch.Tensor):
                return value
            fake = self.fake_mode.from_tensor(value)
            self._keep(fake, value)
            return fake

        return tree_map(to_fake, real)


@contextmanager
def fake_tensors() -> Iterator[FakeTensorMode]:
    """Tensors created or computed inside are FakeTensors (no storage), with known small values.

    The only real computation inside is on small index tensors, so it runs on one thread: an
    OpenMP team costs more than such work (torch.unique of 64k ids takes 20x longer on two busy cores).
    """
    mode = FakeTensorMode(allow_non_fake_inputs=False)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with mode, KnownValuesMode(mode):
            yield mode
    finally:
        torch.set_num_threads(threads)
