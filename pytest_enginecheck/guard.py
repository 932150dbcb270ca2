"""The CUDA guard: catch every way torch could initialize CUDA, and say where it happened.

Every CUDA-initializing path in torch (factories with ``device="cuda"``, ``.cuda()``, ``.to("cuda")``,
``get_device_properties``, ``current_device``, ``mem_get_info``...) calls the Python function
``torch.cuda._lazy_init``, looked up at call time, so replacing it intercepts them all. Submodules
that hold their own reference get the replacement too. On a CPU-only build some calls fail before
reaching it (``set_device``, ``Stream``, ``Event``, ``device()``, RNG state, peak statistics,
``pin_memory``): those are wrapped as well, so a CPU CI machine reports exactly what a GPU host
would have initialized. In strict mode, ``is_available()`` and ``device_count()`` are reported too:
without ``PYTORCH_NVML_BASED_CUDA_CHECK=1`` they run cuInit on GPU hosts, which breaks later forks.

Each access is recorded (even if the caller swallows the exception) with the API, the file and line
in the caller's code, and the chain of modules being imported at that moment.

A module the warm parent preloaded is never imported again in a check child, so a strict guard there
could not see the queries its import made: the warm parent records them (``remember_preload_queries``),
and a strict guard blames each on whatever imports a module of its import chain.

A guard given ``blames`` guards one party's code among others that run in the same process (a model inside an
engine's rank, where the engine's own platform code asks about CUDA as it may): an access is recorded and refused
only where ``blames`` says its caller (the innermost frame outside torch and this module) is that party's; any other
runs the original function, as if no guard were on.
"""

from __future__ import annotations

import builtins
import importlib.util
import os
import re
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from types import FrameType
from typing import Any

# Functions of torch.cuda that, on a CUDA build, initialize CUDA but on a CPU build fail before
# reaching _lazy_init; wrapped so both builds report them the same way.
_EARLY_FAILING_FUNCTIONS = (
    "set_device", "stream", "get_rng_state", "get_rng_state_all", "set_rng_state", "set_rng_state_all",
    "reset_peak_memory_stats", "reset_max_memory_allocated", "reset_accumulated_memory_stats", "ipc_collect",
)
_EARLY_FAILING_CLASSES = ("Stream", "Event", "ExternalStream", "device")
_QUERY_FUNCTIONS = ("is_available", "device_count")
# What passes the import check strict or not: no CUDA call at import, not even the query that would guard one.
FIX_HINTS = {
    "init": "Move the call into a function that runs when the model is built or run (cached with functools.cache if "
            "it is expensive), and take the device there from the engine (a parameter's or the input's .device) "
            "instead of naming cuda. Not `if torch.cuda.is_available():` at import: that asks CUDA at import, which "
            "--enginecheck-strict fails.",
    "query": "Ask inside a function that runs when the model is built or run (cached with functools.cache), or take "
             "the device there from the engine (a parameter's or the input's .device). PYTORCH_NVML_BASED_CUDA_CHECK=1 "
             "makes the query use NVML instead of cuInit, but --enginecheck-strict fails a query at import all the "
             "same.",
    "driver": "Load the CUDA driver only inside code that runs on the GPU worker, never at import time.",
}


@dataclass
class CudaAccess:
    """One place where code would have initialized CUDA (or, in strict mode, queried it)."""

    api: str
    kind: str  # "init": initializes CUDA; "query": cuInit on GPU hosts; "driver": libcuda was loaded
    file: str | None = None
    line: int | None = None
    code: str | None = None
    chain: list[str] = field(default_factory=list)

    @property
    def fix_hint(self) -> str:
        return FIX_HINTS[self.kind]

    def describe(self) -> str:
        where = f" at {self.file}:{self.line}" if self.file else ""
        code = f" (`{self.code}`)" if self.code else ""
        chain = f"\nImport chain: {' -> '.join(self.chain)}." if self.chain else ""
        if self.kind == "query":
            what = (f"called {self.api}(){where}{code}, which runs cuInit on a GPU host (unless "
                    f"PYTORCH_NVML_BASED_CUDA_CHECK=1) and makes later forked workers fail.")
        elif self.kind == "driver":
            what = ("loaded the CUDA driver library (libcuda) without going through torch: something "
                    "called cuInit directly (ctypes, cuda-python, pynvml's CUDA calls...).")
        else:
            what = f"initialized CUDA: {self.api}{where}{code}."
        return f"{what}{chain}"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class CudaAccessError(RuntimeError):
    """Raised where guarded code touches CUDA."""

    def __init__(self, access: CudaAccess) -> None:
        super().__init__(f"CUDA touched while the enginecheck CUDA guard is on: {access.describe()}")
        self.access = access


def _torch_dir() -> str:
    import torch

    return os.path.dirname(torch.__file__) + os.sep


def _is_internal(filename: str, torch_dir: str) -> bool:
    return (filename.startswith(torch_dir) or filename == __file__ or filename.startswith("<frozen")
            or filename.startswith(os.path.dirname(os.__file__) + os.sep + "importlib"))


def _guess_api(code: str | None) -> str:
    """The call on a line of user code that reached CUDA from C++ (e.g. ``torch.zeros(..., device="cuda")``)."""
    if code:
        for pattern, name in ((r"\.cuda\(", "Tensor.cuda"), (r"\.to\(", "Tensor.to"),
                              (r"\b(torch(?:\.\w+)+)\s*\(", None)):
            match = re.search(pattern, code)
            if match:
                return name or match.group(1)
    return "a CUDA tensor operation"


def caller(frame: FrameType | None) -> FrameType | None:
    """The innermost frame from ``frame`` outwards that is not torch's, this module's or the import machinery's: the
    code that made the access (what ``locate`` names)."""
    torch_dir = _torch_dir()
    while frame is not None and _is_internal(frame.f_code.co_filename, torch_dir):
        frame = frame.f_back
    return frame


def locate(api: str | None, kind: str, frame: FrameType | None) -> CudaAccess:
    """Describe the access seen from ``frame`` (the guard's caller): user file and line, import chain."""
    torch_dir = _torch_dir()
    frames: list[FrameType] = []
    while frame is not None:
        frames.append(frame)
        frame = frame.f_back
    user_index = next((i for i, f in enumerate(frames) if not _is_internal(f.f_code.co_filename, torch_dir)), None)
    access = CudaAccess(api=api or "", kind=kind)
    if user_index is not None:
        user = frames[user_index]
        access.file, access.line = user.f_code.co_filename, user.f_lineno
        access.code = _source_line(access.file, access.line)
        if not api:
            inner = frames[user_index - 1] if user_index > 0 else None
            if inner is not None and inner.f_code.co_filename.startswith(torch_dir) and \
                    inner.f_code.co_name != "_lazy_init":
                access.api = _public_name(inner)
            else:
                access.api = _guess_api(access.code)
    module_frames = [f for f in reversed(frames) if f.f_code.co_name == "<module>"
                     and not _is_internal(f.f_code.co_filename, torch_dir)]
    # Only modules being imported (their namespace is the one in sys.modules): not __main__, nor code
    # exec'd as a module elsewhere (xdist workers run inside execnet's "__channelexec__").
    access.chain = [name for f in module_frames if (name := str(f.f_globals.get("__name__"))) != "__main__"
                    and getattr(sys.modules.get(name), "__dict__", None) is f.f_globals]
    return access


def _public_name(frame: FrameType) -> str:
    """The name user code calls a torch function by: ``torch.cuda.mem_get_info``, not the
    ``torch.cuda.memory.mem_get_info`` it is defined as, when torch.cuda re-exports it."""
    name, module = frame.f_code.co_name, str(frame.f_globals.get("__name__", "torch"))
    exported = getattr(sys.modules.get("torch.cuda"), name, None)
    if module.startswith("torch.cuda.") and getattr(exported, "__code__", None) is frame.f_code:
        module = "torch.cuda"
    return f"{module}.{name}"


def _source_line(filename: str, lineno: int) -> str | None:
    import linecache

    return linecache.getline(filename, lineno).strip() or None


def libcuda_loaded() -> bool:
    """Whether the CUDA driver library is mapped into this process (Linux; False elsewhere)."""
    try:
        with open("/proc/self/maps") as maps:
            return any("libcuda.so" in line for line in maps)
    except OSError:
        return False


# The queries made while the warm parent preloaded modules under a strict guard, under every module of their
# import chains (a forked check child inherits them).
_preload_queries: dict[str, list[CudaAccess]] = {}


def remember_preload_queries(accesses: list[CudaAccess]) -> None:
    """Record the queries a strict guard saw while the warm parent preloaded a module: a strict guard in its
    children blames each on any import of a module of that query's import chain."""
    for access in accesses:
        for name in access.chain:
            _preload_queries.setdefault(name, []).append(access)


_holders_cache: dict[tuple[str, ...], list[tuple[Any, str]]] = {}


def find_holders(originals: dict[str, Any]) -> list[tuple[Any, str]]:
    """(module, name) of every loaded torch module holding ``originals[name]`` under ``name``
    (always called with ``guarded_originals()``, so the cache holds one answer per module set).

    Reads each module's ``__dict__``, not getattr: torch.ops and torch.classes create (and keep) a
    namespace for any attribute asked of them, and module ``__getattr__``s import lazily. Cached
    per set of loaded torch modules: scanning them costs a forked child ~10 ms of copy-on-write
    page faults, so the warm parent scans once (``import_check`` calls this at import) and its
    children reuse the answer.
    """
    torch_modules = tuple(name for name in sys.modules if name.startswith("torch"))
    holders = _holders_cache.get(torch_modules)
    if holders is None:
        holders = []
        for module_name in torch_modules:
            namespace = getattr(sys.modules[module_name], "__dict__", None) or {}
            holders += [(sys.modules[module_name], name) for name in originals.keys() & namespace.keys()
                        if namespace[name] is originals[name]]
        _holders_cache[torch_modules] = holders
    return holders


def guarded_originals() -> dict[str, Any]:
    """Every torch.cuda attribute a guard (strict or not) replaces, by name."""
    import torch.cuda

    names = ("_lazy_init", *_EARLY_FAILING_FUNCTIONS, *_EARLY_FAILING_CLASSES, *_QUERY_FUNCTIONS)
    return {name: getattr(torch.cuda, name) for name in names if getattr(torch.cuda, name, None) is not None}


class CudaGuard:
    """While active, any CUDA initialization raises CudaAccessError and is recorded in ``accesses``.

    ``strict=True`` also records (without raising) calls of ``torch.cuda.is_available()`` and
    ``device_count()``, except those made while a module of ``engine_packages`` is being imported: the engine's
    own imports are not the model's (vLLM's import queries CUDA through triton, and vLLM sets
    ``PYTORCH_NVML_BASED_CUDA_CHECK=1`` itself, so in its processes those queries run no cuInit). Use as a
    context manager; it restores torch exactly on exit.

    ``blames``: given, only an access whose caller (``caller``: the innermost frame outside torch and this module)
    it returns True for is recorded and refused, a strict query included (raised at once: the guarded party stops
    at its first access); every other access runs the original, as without a guard. The preload's queries are not
    blamed then (the party's imports are not what it guards).
    """

    def __init__(self, strict: bool = False, engine_packages: tuple[str, ...] = (),
                 blames: Callable[[FrameType], bool] | None = None) -> None:
        self.strict = strict
        self.engine_packages = engine_packages
        self.blames = blames
        self.accesses: list[CudaAccess] = []
        self._saved: list[tuple[Any, str, Any]] = []

    @property
    def first_access(self) -> CudaAccess | None:
        return self.accesses[0] if self.accesses else None

    def _record(self, api: str | None, kind: str, frame: FrameType | None) -> CudaAccess:
        access = locate(api, kind, frame)
        self.accesses.append(access)
        return access

    def _spared(self, frame: FrameType | None) -> bool:
        """Whether an access from ``frame`` (the replaced function's caller) runs the original: ``blames`` is
        given and does not blame its caller."""
        if self.blames is None:
            return False
        found = caller(frame)
        return found is None or not self.blames(found)

    def _blocked(self, api: str | None, original: Any) -> Any:
        guard = self

        def blocked(*args: Any, **kwargs: Any) -> Any:
            if guard._spared(sys._getframe(1)):
                return original(*args, **kwargs)
            raise CudaAccessError(guard._record(api, "init", sys._getframe(1)))

        return blocked

    def _queried(self, name: str, original: Any) -> Any:
        guard = self

        def queried(*args: Any, **kwargs: Any) -> Any:
            if guard.blames is not None:
                if guard._spared(sys._getframe(1)):
                    return original(*args, **kwargs)
                raise CudaAccessError(guard._record(f"torch.cuda.{name}", "query", sys._getframe(1)))
            access = locate(f"torch.cuda.{name}", "query", sys._getframe(1))
            if not any(module.partition(".")[0] in guard.engine_packages for module in access.chain):
                guard.accesses.append(access)
            return original(*args, **kwargs)

        return queried

    def _importing(self, original: Any) -> Any:
        """``builtins.__import__`` that also blames the preload's queries on an import of a preloaded module."""
        guard = self
        blamed: set[int] = set()

        def importing(name: str, globals: Any = None, locals: Any = None, fromlist: Any = (), level: int = 0) -> Any:
            module = original(name, globals, locals, fromlist, level)
            if level:
                try:
                    name = importlib.util.resolve_name("." * level + name, (globals or {}).get("__package__"))
                except (ImportError, ValueError):
                    return module
            for imported in (name, *(f"{name}.{item}" for item in fromlist or ())):
                for stored in _preload_queries.get(imported, ()):
                    if id(stored) not in blamed:
                        blamed.add(id(stored))
                        here = locate(stored.api, stored.kind, sys._getframe(1)).chain
                        guard.accesses.append(CudaAccess(stored.api, stored.kind, stored.file, stored.line, stored.code,
                                                         [*here, *stored.chain[stored.chain.index(imported):]]))
            return module

        return importing

    def _blocked_class(self, name: str, original: type) -> type:
        guard = self
        api = f"torch.cuda.{name}"
        # constructing a device is harmless; entering it selects one
        method = "__enter__" if name == "device" else "__new__"
        unguarded = getattr(original, method)

        def refuse(*args: Any, **kwargs: Any) -> Any:
            if guard._spared(sys._getframe(1)):
                return unguarded(*args, **kwargs)
            raise CudaAccessError(guard._record(api, "init", sys._getframe(1)))

        return type(name, (original,), {method: refuse, "__module__": original.__module__})

    def _set(self, owner: Any, name: str, value: Any) -> None:
        self._saved.append((owner, name, getattr(owner, name)))
        setattr(owner, name, value)

    def _replace_everywhere(self, replacements: dict[str, tuple[Any, Any]]) -> None:
        """For each ``name: (original, replacement)``, replace ``original`` in every loaded torch
        module that holds it under ``name``."""
        for module, name in find_holders(guarded_originals()):
            original, replacement = replacements.get(name, (None, None))
            if original is not None and module.__dict__.get(name) is original:
                self._saved.append((module, name, original))
                setattr(module, name, replacement)

    def __enter__(self) -> CudaGuard:
        import torch
        import torch.cuda

        cuda = torch.cuda
        replacements: dict[str, tuple[Any, Any]] = {"_lazy_init": (cuda._lazy_init,
                                                                    self._blocked(None, cuda._lazy_init))}
        for name in _EARLY_FAILING_FUNCTIONS:
            original = getattr(cuda, name, None)
            if original is not None:
                replacements[name] = (original, self._blocked(f"torch.cuda.{name}", original))
        for name in _EARLY_FAILING_CLASSES:
            original = getattr(cuda, name, None)
            if isinstance(original, type):
                replacements[name] = (original, self._blocked_class(name, original))
        if self.strict:
            for name in _QUERY_FUNCTIONS:
                original = getattr(cuda, name)
                replacements[name] = (original, self._queried(name, original))
            if _preload_queries and self.blames is None:
                self._set(builtins, "__import__", self._importing(builtins.__import__))
        self._replace_everywhere(replacements)
        self._set(torch.Tensor, "pin_memory", self._blocked("torch.Tensor.pin_memory", torch.Tensor.pin_memory))
        return self

    def __exit__(self, *exc: object) -> None:
        while self._saved:
            owner, name, value = self._saved.pop()
            setattr(owner, name, value)
