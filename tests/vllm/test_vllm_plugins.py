"""vLLM's general plugins from a real plugin distribution: listing, loading, and the plugins check."""

from __future__ import annotations

import os
from typing import Any

import pytest

from pytest_enginecheck.checks import CheckContext, CheckFailure
from pytest_enginecheck.settings import Settings
from tests.vllm.plugin_dist import CUDA_PKG_DIST, DIST, ENTRY_POINTS


def _ctx(workdir: str, name: str, module: str, strict: bool = False) -> CheckContext:
    return CheckContext(check="plugins", spec="vllm", architecture=f"plugin:{name}", module=module, class_name="",
                        workdir=workdir, options=Settings(strict=strict), plugin=name)


def _list() -> list[Any]:
    from pytest_enginecheck.targets.vllm.describe.plugins import list_plugins

    return list_plugins()


def _check(name: str, workdir: str, strict: bool) -> str:
    """The plugins check of one entry point: "passed" or the failure message."""
    from pytest_enginecheck.checks.plugins_check import run
    from pytest_enginecheck.targets.vllm.describe.plugins import list_plugins

    (entry,) = [e for e in list_plugins() if e.name == name]
    try:
        run(_ctx(workdir, name, entry.module, strict))
    except CheckFailure as e:
        return e.message
    return "passed"


def test_lists_every_entry_point_with_its_distribution(in_child: Any) -> None:
    found = {(e.name, e.value, e.distribution) for e in in_child(_list)}
    expected = {(name, value, DIST) for name, value in ENTRY_POINTS.items()} | {
        ("cudapkg", "ectp_cudapkg:register", CUDA_PKG_DIST)}
    assert expected <= found


def _list_filtered() -> list[str]:
    os.environ["VLLM_PLUGINS"] = "clean,hungry"
    return sorted(e.name for e in _list())


def test_vllm_plugins_filters_as_vllm_does(in_child: Any) -> None:
    assert in_child(_list_filtered) == ["clean", "hungry"]


def test_clean_plugin_passes(in_child: Any, tmp_path: Any) -> None:
    assert in_child(_check, "clean", str(tmp_path), False) == "passed"


def test_raising_plugin_fails_naming_distribution_entry_point_and_line(in_child: Any, tmp_path: Any) -> None:
    message = in_child(_check, "raising", str(tmp_path), False)
    assert f"vLLM plugin 'raising' (ectp.entry:register_raising) of distribution {DIST}" in message
    assert "RuntimeError: ectp: the raising plugin cannot find its configuration at " in message
    assert message.endswith("ectp/entry.py:22")


@pytest.mark.parametrize("strict", [True, False])
def test_plugin_package_init_querying_cuda(in_child: Any, tmp_path: Any, strict: bool) -> None:
    message = in_child(_check, "cudapkg", str(tmp_path), strict)
    if not strict:
        assert message == "passed"  # a query is only reported in strict mode
        return
    assert "queried CUDA" in message and "torch.cuda.device_count()" in message
    assert "ectp_cudapkg/__init__.py:3" in message
    assert CUDA_PKG_DIST in message
