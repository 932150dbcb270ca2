"""ActivationTracker: the live and peak bytes of tensors created while it is active.

A TorchDispatchMode sees every tensor an operator returns. Each new storage is counted when it
appears and uncounted when Python frees it (a weak reference's callback), so ``peak_bytes`` is the
exact high-water mark of storage bytes allocated inside the block. Storages that existed before
(weights, inputs) are not counted, nor are views of them. It works the same on real CPU tensors
and on FakeTensors, which is what lets a meta-device estimate equal a real measurement.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Sequence
from typing import Any

import torch
from torch._ops import OpOverload
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.weak import WeakIdKeyDictionary


class ActivationTracker(TorchDispatchMode):
    """Track storage bytes allocated inside a ``with`` block; read ``peak_bytes`` afterwards."""

    def __init__(self, existing: Any = ()) -> None:
        super().__init__()
        self.current_bytes = 0
        self.peak_bytes = 0
        self._seen: WeakIdKeyDictionary = WeakIdKeyDictionary()
        for tensor in tree_leaves(existing):
            if isinstance(tensor, torch.Tensor):
                self._seen[tensor.untyped_storage()] = None

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # torch wraps a mode's __torch_dispatch__ in torch._disable_dynamo unless this says no, and the wrapper's
        # first call imports torch._dynamo (~1 s a process); a torch.compile'd function inside the block still runs
        return False

    def _freed(self, nbytes: int, _storage_ref: weakref.ref) -> None:
        self.current_bytes -= nbytes

    def __torch_dispatch__(self, func: OpOverload, types: Sequence[type], args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for tensor in tree_leaves(out):
            if not isinstance(tensor, torch.Tensor):
                continue
            storage = tensor.untyped_storage()
            if storage in self._seen:
                continue
            nbytes = storage.nbytes()
            self._seen[storage] = weakref.ref(storage, functools.partial(self._freed, nbytes))
            self.current_bytes += nbytes
            self.peak_bytes = max(self.peak_bytes, self.current_bytes)
        return out
