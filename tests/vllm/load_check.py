"""``load[tp=1]`` of one architecture on vLLM's engine, for the tests that start it on a tiny checkpoint the checker
writes (run it in a check child: the ``in_child`` fixture)."""

from __future__ import annotations

import os
from typing import Any

from pytest_enginecheck.checks import CheckContext, CheckFailure, CheckSkip
from pytest_enginecheck.settings import Settings


def load_tp1(workdir: str, architecture: str) -> dict[str, Any] | str:
    """The check's detail where it passes, else ``"CheckFailure: ..."`` / ``"CheckSkip: ..."`` (its message)."""
    from pytest_enginecheck.targets.vllm.checks import CHECK_FUNCTIONS

    os.environ["VLLM_PLUGINS"] = "clean"  # not the test site's raising plugins (tests/vllm/plugin_dist.py)
    ctx = CheckContext(check="load", spec="vllm", architecture=architecture, module="", class_name="",
                       workdir=workdir, tp=1, options=Settings(budget_memory="512MiB", timeout=300.0))
    try:
        detail: dict[str, Any] = CHECK_FUNCTIONS["load"](ctx)
    except (CheckFailure, CheckSkip) as e:
        return f"{type(e).__name__}: {e}"
    return detail


def load(workdir: str, architecture: str, tp: int, plugins: str, strict: bool = False, module: str = "") -> Any:
    """load[tp=``tp``] of ``architecture`` with vLLM's general plugins ``plugins`` (``--enginecheck-strict`` where
    ``strict``; ``module``: the registry's module, as a session's item carries it): the passing detail, (message,
    detail) of a failure, or the reason of a skip."""
    from pytest_enginecheck.targets.vllm.checks import CHECK_FUNCTIONS

    os.environ["VLLM_PLUGINS"] = plugins
    ctx = CheckContext(check="load", spec="vllm", architecture=architecture, module=module, class_name="",
                       workdir=workdir, tp=tp,
                       options=Settings(budget_memory="512MiB", timeout=300.0, strict=strict))
    try:
        return CHECK_FUNCTIONS["load"](ctx)
    except CheckFailure as e:
        return e.message, e.detail
    except CheckSkip as e:
        return str(e)
