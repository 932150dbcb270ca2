"""The config class vLLM itself parses an architecture's checkpoint with (its config registry, else transformers').
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pytest_enginecheck.targets.vllm.checkpoints.remote_config import model_modules
from pytest_enginecheck.targets.vllm.checkpoints.shrink import (
    NoTinyCheckpoint,
)

# Fields of the hub checkpoints that vLLM's model reads and its config class does not default (ChatGLM's
# ``original_rope``) or defaults in another form (Step3's MoE layers, a comma-separated string on the hub: the tiny
# model's second layer), by model_type.
HUB_FIELDS: dict[str, dict[str, Any]] = {"chatglm": {"original_rope": True}, "step3_text": {"moe_layers_enum": "1"}}
CONFIG_REGISTRY = (("vllm.transformers_utils.config", "_CONFIG_REGISTRY"),)
ARCHITECTURE_TO_MODEL_TYPE = (("vllm.transformers_utils.config", "_ARCHITECTURE_TO_MODEL_TYPE"),)


class RemoteConfigOnly(NoTinyCheckpoint):
    """Neither transformers nor vLLM's config registry has the architecture's config class: only the hub
    checkpoint's remote code defines it (remote_config.py writes one)."""


def _config_registry() -> Mapping[str, Any]:
    from pytest_enginecheck.targets.vllm.probe import find

    registry: Mapping[str, Any] = find(CONFIG_REGISTRY, "the tiny checkpoint finds vLLM's own config classes in")
    return registry


def _resolve(model_type: str) -> type | None:
    """The class vLLM parses a config.json of ``model_type`` with: its config registry's first, then transformers'."""
    import transformers

    if model_type in _config_registry():
        found: type = _config_registry()[model_type]
        return found
    mapping = transformers.CONFIG_MAPPING  # transformers' lazy mapping: its get() does not look the type up
    return mapping[model_type] if model_type in mapping else None  # noqa: SIM401


def architecture_to_model_type() -> Mapping[str, str]:
    """vLLM's map of the architectures whose checkpoints name no model_type ({} where this vLLM has none)."""
    from pytest_enginecheck.targets.vllm.probe import VllmUnavailable, find

    try:
        found: Mapping[str, str] = find(ARCHITECTURE_TO_MODEL_TYPE, "vLLM maps architectures to model types")
    except VllmUnavailable:
        return {}
    return found


def vllm_config_class(architecture: str, model_cls: type) -> tuple[str, type]:
    """The ``model_type`` the checkpoint's config.json names for ``architecture`` and the config class vLLM parses it
    with: vLLM's own architecture -> model type map, else the model module's name where vLLM's config registry has it
    (``step3p5``), else the one model type of the config classes the model's modules import (ChatGLM's
    ``ChatGLMConfig``). NoTinyCheckpoint where none is found (a config that only remote code defines)."""
    by_architecture = architecture_to_model_type()
    modules = model_modules(model_cls)
    candidates = [by_architecture.get(architecture)]
    candidates += [name for m in modules if (name := m.__name__.rsplit(".", 1)[-1]) in _config_registry()]
    for model_type in candidates:
        if model_type and (found := _resolve(model_type)) is not None:
            return model_type, found
    from transformers import PretrainedConfig

    imported = {getattr(o, "model_type", "") for m in modules for o in vars(m).values()
                if isinstance(o, type) and issubclass(o, PretrainedConfig) and o is not PretrainedConfig}
    resolved = sorted(t for t in imported if t and _resolve(t) is not None)
    missing: list[str] = []
    if len(resolved) == 1:
        model_type = resolved[0]
        config_cls = _resolve(model_type)
        assert config_cls is not None
        missing = _unread(model_cls, config_cls)
        if not missing:
            return model_type, config_cls
    where = ", ".join(m.__name__ for m in modules)
    if missing:  # DeciLM's modules import LlamaConfig, and read block_configs, which only its remote config has
        raise RemoteConfigOnly(f"the config class {resolved[0]!r} that {architecture}'s modules import has no "
                               f"{', '.join(missing)}, which the model reads: its config comes from remote code")
    raise RemoteConfigOnly(f"neither transformers nor vLLM's config registry has a config class for {architecture} "
                           f"(its modules {where} import "
                           f"{'the config classes of ' + ', '.join(resolved) if resolved else 'none vLLM resolves'}): "
                           f"its config comes from remote code")


def _unread(model_cls: type, config_cls: type) -> list[str]:
    """The config fields vLLM's ``model_cls`` reads without a default (remote_config.model_config_reads) that the
    default ``config_cls`` has not."""
    from pytest_enginecheck.targets.vllm.checkpoints.remote_config import model_config_reads

    try:
        defaults = config_cls()
    except Exception:  # noqa: BLE001 - judged where the tiny config is built (tiny_vllm_config)
        return []
    return sorted(field for field in model_config_reads(model_cls).required if not hasattr(defaults, field))
