"""SGLang's out-of-tree models as the target's general plugin: the package ``SGLANG_EXTERNAL_MODEL_PACKAGE`` names.

SGLang has no plugin entry points for models; it loads one package by name (``registry.py``: at import,
``import_model_classes(SGLANG_EXTERNAL_MODEL_PACKAGE)``): it imports the package, then each of its modules,
dropping with a logged warning a module that fails, and registers the ``EntryClass`` of the others. The plugin
is that package, not its modules: the package is what the user names and SGLang imports as a whole (its
``__init__`` raising takes every architecture of it with it, while a module that fails costs only its own), and
each module is already an item of the import and inspect checks, with its CUDA chain. So:

- ``run_plugin`` imports the package (its ``__init__``) under the guard, as SGLang does first;
- ``run_in_engine_state`` loads it as SGLang does, in a fresh interpreter with the variable set
  (``from sglang.srt.models.registry import ModelRegistry``), and fails when SGLang's registry raises or
  serves fewer architectures than the package's ``EntryClass`` assignments list: the silent drop, named.
"""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
import traceback
from dataclasses import dataclass
from importlib.metadata import packages_distributions

from pytest_enginecheck.guard import CudaGuard
from pytest_enginecheck.targets import PluginOutcome
from pytest_enginecheck.targets.sglang import ENGINE_PACKAGES
from pytest_enginecheck.targets.sglang.discovery import DiscoveryError, discover
from pytest_enginecheck.targets.sglang.env import EXTERNAL_VARIABLE, engine_environment, external_package

DROP_WARNING = "Ignore import error when loading"  # SGLang's log line for a module its scan drops
ENGINE_STATE_TIMEOUT_S = 240.0
# A fresh interpreter in SGLang's state: its registry, loaded as it loads itself; prints what it registered.
REGISTRY_SCRIPT = """\
import json, logging
dropped = []
class Kept(logging.Handler):
    def emit(self, record):
        dropped.append(record.getMessage())
logging.getLogger("sglang.srt.models.registry").addHandler(Kept(logging.WARNING))
from sglang.srt.models.registry import ModelRegistry
print("ENGINECHECK " + json.dumps({"architectures": sorted(ModelRegistry.models), "warnings": dropped}))
"""


@dataclass(frozen=True)
class PluginEntry:
    """The out-of-tree package, as a plugin: ``value`` and ``module`` are the package's name."""

    name: str
    value: str
    distribution: str

    @property
    def module(self) -> str:
        return self.value


def _distribution(package: str) -> str:
    top = package.split(".")[0]
    return ",".join(packages_distributions().get(top, [])) or "none (on the path)"


def list_plugins() -> list[PluginEntry]:
    """The package ``SGLANG_EXTERNAL_MODEL_PACKAGE`` names (the user's), or none."""
    package = external_package()
    return [PluginEntry(package, package, _distribution(package))] if package else []


def architectures(package: str) -> tuple[str, ...]:
    """The architectures the package's modules list in ``EntryClass`` (from their sources)."""
    try:
        return tuple(arch for module in discover(package) for arch, _ in module.classes)
    except DiscoveryError:
        return ()


def _user_frames(exc: BaseException) -> list[traceback.FrameSummary]:
    return [f for f in traceback.extract_tb(exc.__traceback__) if "importlib" not in f.filename
            and not f.filename.startswith("<frozen") and "pytest_enginecheck" not in f.filename]


def run_plugin(entry: PluginEntry, strict: bool = False) -> PluginOutcome:
    """Import the package under the guard, as SGLang's registry does before it scans the package's modules."""
    outcome = PluginOutcome(entry, registered=architectures(entry.value))
    with CudaGuard(strict=strict, engine_packages=ENGINE_PACKAGES) as guard:
        try:
            importlib.import_module(entry.value)
        except BaseException as e:  # noqa: BLE001 - reported as the plugin's failure
            frames = _user_frames(e)
            outcome.error = e
            outcome.traceback = "".join(traceback.format_list(frames)) + "".join(traceback.format_exception_only(e))
            outcome.location = f"{frames[-1].filename}:{frames[-1].lineno}" if frames else None
    outcome.accesses = sorted(guard.accesses, key=lambda a: a.kind != "init")
    return outcome


_loaded: list[PluginOutcome] | None = None


def load_plugins(strict: bool = False) -> list[PluginOutcome]:
    """The package's outcome, once per process."""
    global _loaded
    if _loaded is None:
        _loaded = [run_plugin(entry, strict) for entry in list_plugins()]
    return _loaded


def registry_verdict(listed: tuple[str, ...], answer: dict[str, object]) -> tuple[bool, str]:
    """Whether SGLang's registry (its ``answer``) serves every listed architecture; the sentence saying so."""
    served = set(answer.get("architectures") or ())  # type: ignore[call-overload]
    missing = [arch for arch in listed if arch not in served]
    if not missing:
        return True, f"SGLang's registry serves {', '.join(listed) or 'no architecture'}"
    warnings = [w for w in answer.get("warnings") or () if DROP_WARNING in str(w)]  # type: ignore[attr-defined]
    why = f": it logged {'; '.join(map(repr, warnings))}" if warnings else ""
    return False, f"SGLang's registry silently dropped {', '.join(missing)}{why}"


def run_in_engine_state(entry: PluginEntry, timeout: float = ENGINE_STATE_TIMEOUT_S) -> tuple[bool, str, str]:
    """Load the package as SGLang does, in a fresh interpreter: (every listed architecture served, the output, what
    that state is)."""
    state = (f"SGLang's own registry in a fresh interpreter ({EXTERNAL_VARIABLE}={entry.value}, "
             f"from sglang.srt.models.registry import ModelRegistry)")
    env = engine_environment()
    env[EXTERNAL_VARIABLE] = entry.value
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p and os.path.isdir(p))
    try:
        done = subprocess.run([sys.executable, "-c", REGISTRY_SCRIPT], env=env, capture_output=True, text=True,
                              timeout=timeout)
    except subprocess.TimeoutExpired:
        return False, f"it did not finish within {timeout:g} s", state
    lines = [line for line in done.stdout.splitlines() if line.startswith("ENGINECHECK ")]
    if done.returncode != 0 or not lines:
        return False, done.stderr.strip()[-4000:] or f"exit code {done.returncode}", state
    ok, sentence = registry_verdict(architectures(entry.value), json.loads(lines[-1][len("ENGINECHECK "):]))
    return ok, sentence, state
