"""ModelRegistry: architecture name -> model class, lazily, with inspection in a subprocess.

Registering or listing imports nothing: an entry is a "module:Class" string until a worker needs
the class. ``inspect_model_cls`` learns a model's capabilities (ModelInfo) by importing it in a warm
child process, so a model module that misbehaves at import (touches CUDA, crashes, hangs) cannot
break the process that asked. Results are cached as JSON keyed by a hash of the module's source,
so a later run serves them without any subprocess until the model's file changes.

The cache is input, not truth: anyone who can write the directory can write an entry with the right
hash. An entry is served only if every field has its type and it describes the module and class the
registry asked about (the ModelInfo's module and class are what workers import); anything else is a
corrupt entry, logged, inspected again and rewritten. The reader caps the file's size and nesting.

Every lookup is counted by where its answer came from (``CacheStats``: memory, disk, or an inspection
and why), per registry and summed over the process (``process_cache_stats``), so a run can show whether
the cache really hits.
"""

from __future__ import annotations

import difflib
import hashlib
import importlib
import importlib.machinery
import json
import logging
import os
import sys
import tempfile
import threading
import traceback
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Any

from engine_ref import envs
from engine_ref.errors import ModelInspectionError, UnknownArchitectureError
from engine_ref.model_executor.models.interfaces import ModelInfo
from engine_ref.utils import read_json

logger = logging.getLogger(__name__)

MODEL_INFO_FORMAT_VERSION = 1
# A ModelInfo also depends on the markers and base classes a model inherits, which live here
# (Qwen2 and out-of-tree models subclass LlamaForCausalLM): their sources are part of every hash.
_BUNDLED_MODELS_DIR = Path(__file__).parent
DEFAULT_INSPECT_TIMEOUT_S = 120.0
MODEL_INFO_CACHE_MAX_BYTES = 64 * 1024  # an entry is about 500 bytes
MODEL_INFO_CACHE_MAX_DEPTH = 2  # {"model_info": {field: scalar}}
_MODEL_INFO_TYPES: dict[str, type] = {f.name: {"str": str, "bool": bool}[str(f.type)] for f in fields(ModelInfo)}

_ENGINE_REF_MODELS = {
    # architecture: (module under engine_ref.model_executor.models, class)
    "LlamaForCausalLM": ("llama", "LlamaForCausalLM"),
    "Qwen2ForCausalLM": ("qwen2", "Qwen2ForCausalLM"),
    "MixtralForCausalLM": ("mixtral", "MixtralForCausalLM"),
    "Qwen3MoeForCausalLM": ("qwen3_moe", "Qwen3MoeForCausalLM"),
    "LlavaForConditionalGeneration": ("llava", "LlavaForConditionalGeneration"),
}


@dataclass
class CacheStats:
    """How ModelInfo lookups were served: from memory, from the JSON cache, or by an inspection and why.

    ``missing``: no cache file; ``source_changed`` / ``format_version``: a stale file (another source hash,
    another MODEL_INFO_FORMAT_VERSION); ``no_source``: no source file to hash, so nothing can be cached;
    ``corrupt``: an unreadable or invalid file (inspected again and rewritten).
    """

    memory: int = 0
    disk: int = 0
    missing: int = 0
    source_changed: int = 0
    format_version: int = 0
    no_source: int = 0
    corrupt: int = 0

    @property
    def inspected(self) -> int:
        """Lookups that needed an inspection for want of a usable entry (corrupt ones are counted apart)."""
        return self.missing + self.source_changed + self.format_version + self.no_source

    def to_dict(self) -> dict[str, int]:
        return asdict(self)


CACHE_OUTCOMES = tuple(f.name for f in fields(CacheStats))
_process_stats = CacheStats()  # every registry of this process, summed
_stats_lock = threading.Lock()  # guards every CacheStats (a registry's and the process's)


def process_cache_stats() -> dict[str, int]:
    """The ModelInfo lookups of every registry in this process so far, by outcome (CACHE_OUTCOMES)."""
    with _stats_lock:
        return _process_stats.to_dict()


@dataclass(frozen=True)
class RegisteredModel:
    """One registry entry: where the class lives, or the class itself for in-process registrations."""

    module_name: str
    class_name: str
    model_cls: type | None = None

    @classmethod
    def parse(cls, spec: str | type) -> RegisteredModel:
        if isinstance(spec, type):
            return cls(spec.__module__, spec.__qualname__, spec)
        module_name, sep, class_name = spec.partition(":")
        if not sep or not module_name or not class_name:
            raise ValueError(f"model class {spec!r} must be written 'package.module:ClassName'.")
        return cls(module_name, class_name)

    @property
    def spec(self) -> str:
        return f"{self.module_name}:{self.class_name}"

    def load_model_cls(self) -> type:
        """Import the module and return the class (an AttributeError-free, clear error if absent)."""
        if self.model_cls is not None:
            return self.model_cls
        module = importlib.import_module(self.module_name)
        try:
            return getattr(module, self.class_name)
        except AttributeError:
            raise ImportError(
                f"module {self.module_name!r} has no class {self.class_name!r}; "
                f"fix the registration {self.spec!r} or define the class."
            ) from None

    def source_hash(self) -> str | None:
        """sha256 of the module's source file (found without importing the module or its packages) and of
        the bundled models' sources."""
        try:
            spec = _find_spec_without_import(self.module_name)
        except Exception:  # noqa: BLE001 - a finder's own failure: no hash, the child will report it
            return None
        if spec is None or not spec.origin or not os.path.isfile(spec.origin):
            return None
        digest = hashlib.sha256(Path(spec.origin).read_bytes())
        for path in sorted(_BUNDLED_MODELS_DIR.glob("*.py")):
            digest.update(path.read_bytes())
        digest.update(f"{self.spec}\0{MODEL_INFO_FORMAT_VERSION}".encode())
        return digest.hexdigest()


def _find_spec_without_import(module_name: str) -> importlib.machinery.ModuleSpec | None:
    """Locate a module as the import system would, without executing it or its parent packages.

    ``importlib.util.find_spec("pkg.models.x")`` imports ``pkg`` and ``pkg.models``: a plugin
    package's ``__init__`` would then run in the process that asked for an inspection.
    """
    path = None
    spec = None
    parts = module_name.split(".")
    for i in range(1, len(parts) + 1):
        name = ".".join(parts[:i])
        module = sys.modules.get(name)
        spec = getattr(module, "__spec__", None)
        if spec is None:
            for finder in sys.meta_path:
                find_spec = getattr(finder, "find_spec", None)
                spec = find_spec(name, path) if find_spec is not None else None
                if spec is not None:
                    break
            else:
                return None
        path = getattr(module, "__path__", None) or spec.submodule_search_locations
        if path is None and i < len(parts):
            return None  # a parent that is not a package
    return spec


def unknown_architecture_error(arch: str, supported: list[str]) -> UnknownArchitectureError:
    """The error for an architecture no registry entry matches, listing the nearest names."""
    near = difflib.get_close_matches(arch, supported, n=3, cutoff=0.5)
    hint = f" Did you mean {', '.join(near)}?" if near else ""
    return UnknownArchitectureError(
        f"Architecture {arch!r} is not registered.{hint} Registered: {', '.join(sorted(supported))}. "
        f"Register an out-of-tree model with ModelRegistry.register_model({arch!r}, 'module:Class')."
    )


def _inspect_in_subprocess(architecture: str, entry: RegisteredModel) -> ModelInfo | str:
    """Runs in the child: import the model class and derive its ModelInfo.

    A failure comes back as its traceback text, not as the exception: the model's own exception
    class may not unpickle in the parent (or would import the model's modules there), and a
    SystemExit raised by a model module must not end the parent.
    """
    try:
        info = ModelInfo.from_model_cls(architecture, entry.load_model_cls())
    except BaseException:  # noqa: BLE001 - this child exists to report it
        return traceback.format_exc()
    # Workers import the class where it is registered (a re-exported class's __module__ is elsewhere).
    return replace(info, module=entry.module_name, class_name=entry.class_name)


class _ModelRegistry:
    """Maps architecture names (config.json's ``architectures``) to model classes."""

    def __init__(self, models: dict[str, RegisteredModel]) -> None:
        self.models = dict(models)
        self._infos: dict[tuple[str, str | None], ModelInfo] = {}
        self._lock = threading.Lock()
        self.subprocess_inspections = 0  # how many inspections needed a child process
        self.cache_stats = CacheStats()  # how this registry's lookups were served

    def _count(self, outcome: str) -> None:
        """One lookup served by ``outcome`` (a CACHE_OUTCOMES name), here and in the process's total."""
        with _stats_lock:
            for stats in (self.cache_stats, _process_stats):
                setattr(stats, outcome, getattr(stats, outcome) + 1)

    def get_supported_archs(self) -> list[str]:
        """Every registered architecture name. Imports nothing."""
        return list(self.models)

    def register_model(self, architecture: str, model_cls: str | type) -> None:
        """Register (or replace) an architecture: ``"package.module:Class"`` (lazy) or a class."""
        if architecture in self.models:
            logger.warning("model architecture %s is already registered; overwriting it", architecture)
        self.models[architecture] = RegisteredModel.parse(model_cls)

    def _entry(self, architecture: str) -> RegisteredModel:
        try:
            return self.models[architecture]
        except KeyError:
            raise unknown_architecture_error(architecture, self.get_supported_archs()) from None

    def resolve_model_cls(self, architecture: str) -> type:
        """Import and return the model class, in this process (workers call this)."""
        return self._entry(architecture).load_model_cls()

    def inspect_model_cls(self, architecture: str, timeout: float = DEFAULT_INSPECT_TIMEOUT_S) -> ModelInfo:
        """The ModelInfo of an architecture: from memory, else the JSON cache, else a subprocess."""
        entry = self._entry(architecture)
        if entry.model_cls is not None:  # registered as a class: already imported here
            return ModelInfo.from_model_cls(architecture, entry.model_cls)
        source_hash = entry.source_hash()
        key = (architecture, source_hash)
        with self._lock:
            info = self._infos.get(key)
        if info is not None:
            self._count("memory")
            return info
        info, outcome = self._read_cache(architecture, entry, source_hash)
        self._count(outcome)
        if info is None:
            info = self._inspect_with_subprocess(architecture, entry, timeout)
            self._write_cache(entry, source_hash, info)
        with self._lock:
            self._infos[key] = info
        return info

    def inspect_all(self, architectures: Iterable[str] | None = None,
                    max_workers: int | None = None) -> dict[str, ModelInfo | Exception]:
        """Inspect many architectures at once, each in its own warm child, ``max_workers`` at a time.

        Returns each architecture's ModelInfo, or the exception its inspection raised.
        """
        archs = list(architectures if architectures is not None else self.models)
        workers = max_workers or min(len(archs), os.cpu_count() or 1) or 1

        def inspect(arch: str) -> ModelInfo | Exception:
            try:
                return self.inspect_model_cls(arch)
            except Exception as e:  # noqa: BLE001 - reported per architecture
                return e

        with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="inspect") as pool:
            return dict(zip(archs, pool.map(inspect, archs), strict=True))

    def _inspect_with_subprocess(self, architecture: str, entry: RegisteredModel, timeout: float) -> ModelInfo:
        from engine_ref.isolation import IsolatedProcessError, RemoteTraceback, run_isolated

        with self._lock:
            self.subprocess_inspections += 1
        crash: IsolatedProcessError | None = None  # the cause: a ProcessTimeoutError holds the child's stacks
        try:
            result = run_isolated(_inspect_in_subprocess, architecture, entry, timeout=timeout,
                                  name=f"inspect {architecture}")
            if isinstance(result, ModelInfo):
                return result
            detail = result
        except IsolatedProcessError as e:
            detail, crash = str(e), e
        except Exception as e:  # noqa: BLE001 - the child's own error, carried verbatim
            cause = e.__cause__
            detail = cause.text if isinstance(cause, RemoteTraceback) else f"{type(e).__name__}: {e}"
        raise ModelInspectionError(
            f"Error inspecting model architecture {architecture!r} ({entry.spec}) in a subprocess. "
            f"The child process reported:\n{detail}"
        ) from crash

    # -- the JSON cache ------------------------------------------------------------------------

    @staticmethod
    def _cache_path(architecture: str, entry: RegisteredModel) -> Path:
        """One file per architecture and class (two architectures may share a class)."""
        return envs.cache_root() / "modelinfos" / f"{architecture}-{entry.module_name}-{entry.class_name}.json"

    def _read_cache(self, architecture: str, entry: RegisteredModel, source_hash: str | None
                    ) -> tuple[ModelInfo | None, str]:
        """The cached ModelInfo and "disk"; else None and why (a CACHE_OUTCOMES name; corrupt ones are logged)."""
        if source_hash is None:
            return None, "no_source"
        path = self._cache_path(architecture, entry)
        try:
            data = read_json(path, max_bytes=MODEL_INFO_CACHE_MAX_BYTES, max_depth=MODEL_INFO_CACHE_MAX_DEPTH)
            return _cached_model_info(data, architecture, entry, source_hash)
        except FileNotFoundError:
            return None, "missing"
        except (OSError, ValueError) as e:
            logger.warning("corrupt model info cache %s (%s): inspecting %s again and rewriting it",
                           path, e, architecture)
            return None, "corrupt"

    def _write_cache(self, entry: RegisteredModel, source_hash: str | None, info: ModelInfo) -> None:
        """Write atomically (temp file + rename), so concurrent writers and readers never see half a file."""
        if source_hash is None:
            return
        path = self._cache_path(info.architecture, entry)
        data = {"format_version": MODEL_INFO_FORMAT_VERSION, "source_hash": source_hash,
                "model_info": info.to_dict()}
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
            try:
                with os.fdopen(fd, "w") as f:
                    json.dump(data, f, indent=2)
                os.replace(tmp, path)
            except BaseException:
                os.unlink(tmp)
                raise
        except OSError as e:
            logger.warning("could not write model info cache %s: %s", path, e)


def _cached_model_info(data: Any, architecture: str, entry: RegisteredModel, source_hash: str
                       ) -> tuple[ModelInfo | None, str]:
    """The ModelInfo of a parsed cache file and "disk"; None and why it is stale (a CACHE_OUTCOMES name);
    ValueError saying what is corrupt."""
    if not isinstance(data, dict) or set(data) != {"format_version", "source_hash", "model_info"}:
        raise ValueError("not an object of exactly format_version, source_hash and model_info")
    if type(data["format_version"]) is not int or not isinstance(data["source_hash"], str):
        raise ValueError(f"format_version={data['format_version']!r} is not an integer or "
                         f"source_hash={data['source_hash']!r} not a string")
    if data["format_version"] != MODEL_INFO_FORMAT_VERSION:
        return None, "format_version"  # written for another format: stale, not corrupt
    if data["source_hash"] != source_hash:
        return None, "source_changed"
    info = data["model_info"]
    if not isinstance(info, dict) or set(info) != set(_MODEL_INFO_TYPES):
        raise ValueError(f"model_info is not an object of exactly the fields {', '.join(_MODEL_INFO_TYPES)}")
    wrong = [f"{name}={value!r}" for name, value in info.items() if type(value) is not _MODEL_INFO_TYPES[name]]
    if wrong:
        raise ValueError(f"fields of the wrong type: {', '.join(wrong)}")
    asked = {"architecture": architecture, "module": entry.module_name, "class_name": entry.class_name}
    foreign = [f"{name}={info[name]!r} (asked: {value!r})" for name, value in asked.items() if info[name] != value]
    if foreign:
        raise ValueError(f"it describes another model: {', '.join(foreign)}")
    return ModelInfo(**info), "disk"


ModelRegistry = _ModelRegistry({
    arch: RegisteredModel(f"engine_ref.model_executor.models.{module}", cls)
    for arch, (module, cls) in _ENGINE_REF_MODELS.items()
})
