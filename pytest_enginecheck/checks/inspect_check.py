"""inspect: the target's own inspection path can inspect the architecture in a subprocess.

engine_ref: ``ModelRegistry.inspect_model_cls`` (its subprocess and JSON cache). vLLM: the
registered model's ``inspect_model_cls`` (vLLM's own subprocess). Errors are surfaced verbatim.
"""

from __future__ import annotations

from dataclasses import asdict, is_dataclass
from typing import Any

from pytest_enginecheck.checks import CheckContext, CheckFailure
from pytest_enginecheck.targets import into_global_registry, resolve


def _inspect_vllm(ctx: CheckContext, registry: Any) -> dict[str, Any]:
    try:
        info = registry.models[ctx.architecture].inspect_model_cls()
    except Exception as e:  # noqa: BLE001 - vLLM's own error, verbatim
        raise CheckFailure(f"vLLM could not inspect {ctx.architecture}:\n{e}", {"kind": "inspection"}) from None
    return asdict(info) if is_dataclass(info) else {"info": repr(info)}


def run(ctx: CheckContext) -> dict[str, Any]:
    from engine_ref.errors import EngineRefError

    kind, target = resolve(ctx.spec)
    if kind == "vllm":
        return _inspect_vllm(ctx, target)
    registry = into_global_registry(kind, target)
    try:
        info = registry.inspect_model_cls(ctx.architecture)
    except EngineRefError as e:
        raise CheckFailure(str(e), {"kind": "inspection"}) from None
    return info.to_dict()
