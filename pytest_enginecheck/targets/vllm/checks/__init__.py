"""The checks of ``--enginecheck-target=vllm``, each run in a warm check child like engine_ref's.

``CHECK_FUNCTIONS[check](ctx)`` returns the passing result's detail or raises CheckFailure /
CheckSkip, the contract of ``pytest_enginecheck.checks``. The child first loads vLLM's general
plugins under the guard (``registry.list_architectures``), as vLLM's own processes do. The plugins
check is the core's ``checks/plugins_check.py``, with ``plugins`` as its loader.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from pytest_enginecheck.checks import CheckContext, CheckSkip
from pytest_enginecheck.targets.vllm.checks.budget import run_budget
from pytest_enginecheck.targets.vllm.checks.import_check import run_import
from pytest_enginecheck.targets.vllm.checks.inspect_check import run_inspect
from pytest_enginecheck.targets.vllm.checks.leftovers import reported_after
from pytest_enginecheck.targets.vllm.checks.load import run_load
from pytest_enginecheck.targets.vllm.checks.lora import run as run_lora
from pytest_enginecheck.targets.vllm.checks.quant import run as run_quant
from pytest_enginecheck.targets.vllm.checks.startup import run_startup
from pytest_enginecheck.targets.vllm.probe import VllmUnavailable


def skips_unavailable(check: Callable[[CheckContext], dict[str, Any]]) -> Callable[[CheckContext], dict[str, Any]]:
    """``check``, with a part of vLLM's API it needs missing (VllmUnavailable from the probe) ending in a CheckSkip
    that names it, rather than an error deep inside the check."""

    @functools.wraps(check)
    def run(ctx: CheckContext) -> dict[str, Any]:
        try:
            return check(ctx)
        except VllmUnavailable as e:
            from pytest_enginecheck.targets.vllm.window import skip_words

            raise CheckSkip(f"{e} ({skip_words()})") from None

    return run


CHECK_FUNCTIONS: dict[str, Callable[[CheckContext], dict[str, Any]]] = {
    name: skips_unavailable(check) for name, check in
    {"import": run_import, "inspect": run_inspect, **{name: reported_after(check) for name, check in {
        "load": run_load, "budget": run_budget, "startup": run_startup, "lora": run_lora, "quant": run_quant}.items()}
     }.items()
}
