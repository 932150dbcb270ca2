"""inspect: the target's own inspection path can inspect the architecture in a subprocess.

engine_ref: ``ModelRegistry.inspect_model_cls`` (its subprocess and JSON cache). Errors are surfaced
verbatim. (Each target has its own inspect check: the vLLM one is ``targets.vllm.checks.run_inspect``.)

A model that hangs hangs in the inspection's own child, below this check's child: that child is
given a shorter timeout than the check, so the report shows its stacks (the hung line), not this
process's wait for it.
"""

from __future__ import annotations

from typing import Any

from pytest_enginecheck.checks import CheckContext, CheckFailure, subject
from pytest_enginecheck.targets.engine_ref.registry import into_global_registry, resolve

INSPECTION_SHARE = 0.8  # of the check's timeout: the rest reads the child's stacks and reports them


def run(ctx: CheckContext) -> dict[str, Any]:
    from engine_ref.errors import EngineRefError
    from engine_ref.isolation import ProcessTimeoutError

    registry = into_global_registry(*resolve(ctx.spec))
    timeout = ctx.options.timeout * INSPECTION_SHARE
    try:
        info = registry.inspect_model_cls(ctx.architecture, timeout=timeout)
    except EngineRefError as e:
        hang = e.__cause__
        if isinstance(hang, ProcessTimeoutError):
            raise CheckFailure(
                f"{subject(ctx)} did not finish within {ctx.options.timeout:g} s (--enginecheck-timeout): the "
                f"registry's inspection child was killed after {timeout:g} s. Its Python stacks at that moment:\n"
                f"{hang.stacks or '(none could be read)'}",
                {"kind": "timeout", "timeout_s": ctx.options.timeout, "stacks": hang.stacks}) from None
        raise CheckFailure(str(e), {"kind": "inspection"}) from None
    return info.to_dict()
