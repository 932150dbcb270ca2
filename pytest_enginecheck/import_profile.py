"""Where an import's time goes: each module it loads, with its self and cumulative time and its chain.

``python -X importtime`` measures this inside CPython's import, but it can only be switched on when the
interpreter starts. The same numbers are measured here in-process, around any import: every import of
a module that is not loaded yet goes through ``importlib._bootstrap._find_and_load`` (the ``import``
statement's C code looks it up on the module at each call, ``importlib.import_module`` by name), so a
profiler replaces it for as long as its ``with`` block runs, times each call with ``perf_counter`` and
subtracts the nested ones. A module's *self* time is what its own body cost, its *cumulative* time
includes the modules it imported for the first time, and its *chain* is the imports in progress when
it was pulled in, from the outermost down to the module itself.

Engine-agnostic and light: it imports nothing but the standard library, so any target's import check
can wrap its import in it::

    with ImportProfiler() as profile:
        importlib.import_module(module)
    detail["import_profile"] = profile.top(PROFILE_TOP, root=module)
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType, TracebackType
from typing import Any

PROFILE_TOP = 25  # entries a check result keeps

_bootstrap: ModuleType = sys.modules["_frozen_importlib"]  # importlib._bootstrap, the one the C import calls
_HOOK = "_find_and_load"


@dataclass(frozen=True)
class ModuleTime:
    """One module loaded under a profiler: its own time, its time with what it imported, and its chain."""

    module: str
    self_s: float
    cumulative_s: float
    chain: tuple[str, ...]  # the imports in progress, outermost first, ending with ``module``

    def to_dict(self, root: str | None = None) -> dict[str, Any]:
        """``{"module", "self_s", "cumulative_s", "chain"}``; the chain starts at ``root`` when it passes it."""
        chain = list(self.chain)
        if root is not None and root in chain:
            chain = chain[chain.index(root):]
        return {"module": self.module, "self_s": round(self.self_s, 6), "cumulative_s": round(self.cumulative_s, 6),
                "chain": chain}


class ImportProfiler:
    """A context manager that records every module first imported by this thread inside its block.

    Imports by other threads and of modules already loaded pass through untimed. Profilers nest (the
    inner one's block is timed by both). ``records`` holds the modules in the order they finished.
    """

    def __init__(self) -> None:
        self.records: list[ModuleTime] = []
        self._thread = 0
        self._original: Callable[[str, Any], ModuleType] | None = None
        self._stack: list[list[Any]] = []  # [name, seconds spent in its nested first imports]

    def __enter__(self) -> ImportProfiler:
        if self._original is not None:
            raise RuntimeError("an ImportProfiler's block cannot be entered twice at once; use another profiler")
        self._thread = threading.get_ident()
        self._original = getattr(_bootstrap, _HOOK)
        setattr(_bootstrap, _HOOK, self._find_and_load)
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if getattr(_bootstrap, _HOOK) == self._find_and_load:
            setattr(_bootstrap, _HOOK, self._original)
        else:  # a later hook wrapped ours and is still installed: keep it, make ours a pass-through
            self._thread = -1
        self._original = None

    def _find_and_load(self, name: str, import_: Any) -> ModuleType:
        original = self._original or _frozen_find_and_load
        if name in sys.modules or threading.get_ident() != self._thread:
            return original(name, import_)
        frame: list[Any] = [name, 0.0]
        self._stack.append(frame)
        start = time.perf_counter()
        try:
            return original(name, import_)
        finally:
            elapsed = time.perf_counter() - start
            self._stack.pop()
            if self._stack:
                self._stack[-1][1] += elapsed
            chain = (*(f[0] for f in self._stack), name)
            self.records.append(ModuleTime(name, max(0.0, elapsed - frame[1]), elapsed, chain))

    def total_s(self) -> float:
        """The time of the outermost imports in the block (the whole of what was profiled)."""
        return sum(r.cumulative_s for r in self.records if len(r.chain) == 1)

    def top(self, n: int = PROFILE_TOP, root: str | None = None) -> list[dict[str, Any]]:
        """The ``n`` modules with the most self time, slowest first, as ModuleTime.to_dict."""
        ranked = sorted(self.records, key=lambda r: (-r.self_s, r.module))
        return [r.to_dict(root) for r in ranked[:n]]


_frozen_find_and_load: Callable[[str, Any], ModuleType] = getattr(_bootstrap, _HOOK)
