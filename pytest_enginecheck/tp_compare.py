"""What every target's TP diagnosis shares: the keys of hooked module calls, the tensor a hook reads, the float32
comparison of TP=N against TP=1, and putting rank outputs split along one dimension back together.

A diagnosis hooks every module of the model on each rank, keys each call (``CallKeys``), keeps the first tensor
of its input and output (``first_tensor``), then compares the ranks' outputs put back together with TP=1's in
the order the calls finished. How a layer's output is sharded is each engine's own (its layers' attributes); what
is here reads only tensors and names, so the targets share it without importing each other. Torch is imported
only where a tensor is handled. Where a module's weight shards are wrong, the diagnosis names the code that loaded
them: each distinct ``param.weight_loader`` of its parameters (``weight_loaders``, read on the rank that holds the
model), as ``qualname (file:line)``.
"""

from __future__ import annotations

import functools
import inspect
import os
from collections.abc import Sequence
from typing import Any

ATOL, RTOL = 1e-4, 1e-3  # TP=N against TP=1 in float32 at tiny sizes: other reduction orders, nothing more


def first_tensor(value: Any) -> Any:
    """``value`` when it is a tensor, else the first tensor of a tuple or list; None when there is none."""
    import torch

    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, (tuple, list)):
        return next((v for v in value if isinstance(v, torch.Tensor)), None)
    return None


class CallKeys:
    """The keys of module calls as forward hooks see them, and the calls running now (innermost last).

    A module's first call is keyed by its name, its later calls ``name (call N)`` (a module shared by the
    layers, such as a rotary embedding, runs once per layer). ``enter`` in the pre-hook, ``leave`` in the hook.
    """

    def __init__(self) -> None:
        self.running: list[str] = []
        self._calls: dict[str, int] = {}

    def enter(self, name: str) -> str:
        """Start a call of module ``name``: its key."""
        self._calls[name] = self._calls.get(name, 0) + 1
        key = name if self._calls[name] == 1 else f"{name} (call {self._calls[name]})"
        self.running.append(key)
        return key

    def leave(self) -> str:
        """End the innermost running call: its key."""
        return self.running.pop()

    @property
    def innermost(self) -> str | None:
        """The key of the innermost call running now (the module a failing forward raised in), or None."""
        return self.running[-1] if self.running else None


def module_name(key: str) -> str:
    """The module's name of a call's key (``name`` or ``name (call 2)``)."""
    return key.split(" (call ")[0]


def close(a: Any, b: Any, atol: float = ATOL, rtol: float = RTOL) -> bool:
    """``a`` is a tensor of ``b``'s shape, equal to it within ``atol``/``rtol`` (NaN where both are NaN)."""
    import torch

    return a is not None and tuple(a.shape) == tuple(b.shape) and torch.allclose(a.float(), b.float(), atol=atol,
                                                                                 rtol=rtol, equal_nan=True)


def max_abs_diff(a: Any, b: Any) -> float:
    """The largest |a - b| of two tensors of one shape (inf where only one is NaN; 0.0 when they are empty)."""
    return float((a.float() - b.float()).abs().nan_to_num(float("inf")).max().item()) if a.numel() else 0.0


def join_split(full: Any, parts: list[Any]) -> tuple[Any, int] | None:
    """The ranks' ``parts`` joined in rank order along the one dimension where they are shorter than ``full``, and
    that dimension; None when they are not ``full`` split so (another number of dimensions, several shorter
    dimensions, or lengths that do not add up)."""
    import torch

    if any(p.dim() != full.dim() for p in parts):
        return None
    shorter = [d for d in range(full.dim()) if any(p.shape[d] != full.shape[d] for p in parts)]
    if len(shorter) != 1 or sum(p.shape[shorter[0]] for p in parts) != full.shape[shorter[0]]:
        return None
    return torch.cat(parts, dim=shorter[0]), shorter[0]


def loader_name(loader: Any) -> str | None:
    """``qualname (file:line)`` of a weight loader: a function, a bound method (its function), a functools.partial
    (what it wraps) or a callable object (its ``__call__``); the file relative to the working directory when inside
    it. None for what is not callable; the qualname alone where there is no Python source (a builtin)."""
    for _ in range(8):  # partials of bound methods of wrappers: a few layers at most
        if isinstance(loader, functools.partial):
            loader = loader.func
        elif inspect.ismethod(loader):
            loader = loader.__func__
        elif hasattr(loader, "__wrapped__"):  # functools.wraps
            loader = loader.__wrapped__
        else:
            break
    if not callable(loader):
        return None
    if not (inspect.isfunction(loader) or inspect.isbuiltin(loader) or inspect.isclass(loader)):
        loader = type(loader).__call__  # a callable object: its class's __call__
        loader = getattr(loader, "__func__", loader)
    return _source_name(loader)


@functools.cache
def _source_name(loader: Any) -> str:
    """``qualname (file:line)`` of a function (once per function: a model's layers share a few loaders)."""
    name = getattr(loader, "__qualname__", None) or type(loader).__qualname__
    try:
        file = inspect.getsourcefile(loader)
        line = inspect.getsourcelines(loader)[1]
    except (OSError, TypeError):
        code = getattr(loader, "__code__", None)
        if code is None:
            return name
        file, line = code.co_filename, code.co_firstlineno
    if file is None:
        return name
    relative = os.path.relpath(file)
    return f"{name} ({file if relative.startswith(os.pardir) else relative}:{line})"


def weight_loaders(module: Any) -> list[str]:
    """The distinct weight loaders of ``module``'s own parameters (``param.weight_loader``), named by ``loader_name``,
    in the order of its parameters; a parameter without one (or whose loader cannot be read) names none."""
    found: list[str] = []
    for _, param in module.named_parameters(recurse=False):
        try:
            name = loader_name(getattr(param, "weight_loader", None))
        except Exception:  # noqa: BLE001 - an engine's parameter whose loader was deleted raises its own error
            name = None
        if name is not None and name not in found:
            found.append(name)
    return found


def loaded_by(loaders: Sequence[str]) -> str:
    """``its parameters were loaded by A (file:line) and B (file:line)``; empty when none is known."""
    if not loaders:
        return ""
    named = loaders[0] if len(loaders) == 1 else f"{', '.join(loaders[:-1])} and {loaders[-1]}"
    return f"its parameters were loaded by {named}"
