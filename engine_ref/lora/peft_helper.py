"""PEFTHelper: an adapter's ``adapter_config.json`` (PEFT's format), read and checked against the engine.

Only what LoRA at inference needs is accepted; a feature engine_ref cannot apply (DoRA, trained
biases, per-module ranks...) is refused by name rather than silently ignored. Imports no torch.
"""

from __future__ import annotations

import json
import math
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine_ref.errors import ConfigError
from engine_ref.lora.config import LoRAConfig

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"

# adapter_config.json fields whose non-default values ask for something engine_ref does not apply.
_UNSUPPORTED = {
    "use_dora": "DoRA (weight-decomposed LoRA)",
    "bias": "trained biases",
    "lora_bias": "a LoRA bias on B",
    "modules_to_save": "fully trained copies of modules",
    "fan_in_fan_out": "transposed (Conv1D) weights",
    "layers_to_transform": "LoRA on some layers only",
    "layer_replication": "replicated layers",
    "rank_pattern": "per-module ranks",
    "alpha_pattern": "per-module alphas",
    "target_parameters": "LoRA on parameters (fused experts)",
}
_DEFAULTS: tuple[object, ...] = (None, False, "none", [], {})


@dataclass(frozen=True)
class PEFTHelper:
    """The fields of ``adapter_config.json`` that LoRA at inference uses."""

    r: int
    lora_alpha: float
    target_modules: list[str]
    base_model_name_or_path: str | None
    use_rslora: bool
    path: Path

    @property
    def scaling(self) -> float:
        """PEFT's scale of B @ A: lora_alpha / r, or lora_alpha / sqrt(r) with use_rslora."""
        return self.lora_alpha / (math.sqrt(self.r) if self.use_rslora else self.r)

    @classmethod
    def from_local_dir(cls, lora_path: str | Path) -> PEFTHelper:
        """Read ``lora_path/adapter_config.json``; raise ConfigError for anything missing or unsupported."""
        path = Path(lora_path)
        config_path = path / ADAPTER_CONFIG
        if not path.is_dir():
            raise ConfigError(f"lora_path={str(lora_path)!r} is not a directory; pass a PEFT adapter directory "
                              f"(adapter_config.json + {ADAPTER_WEIGHTS}), e.g. one written by PEFT's save_pretrained.")
        if not config_path.is_file():
            raise ConfigError(f"{path} has no {ADAPTER_CONFIG}; a PEFT adapter directory needs it (save the "
                              f"adapter with PEFT's save_pretrained).")
        try:
            raw = json.loads(config_path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ConfigError(f"{config_path} is not valid JSON ({e}); fix it or save the adapter again.") from None
        if not isinstance(raw, dict):
            raise ConfigError(f"{config_path} holds a {type(raw).__name__}, not a JSON object; save the adapter again.")
        return cls._from_dict(raw, path, config_path)

    @classmethod
    def _from_dict(cls, raw: dict[str, Any], path: Path, config_path: Path) -> PEFTHelper:
        if raw.get("peft_type", "LORA") != "LORA":
            raise ConfigError(f"{config_path} has peft_type={raw['peft_type']!r}; engine_ref runs LoRA adapters "
                              f"only (peft_type 'LORA').")
        for name, meaning in _UNSUPPORTED.items():
            if raw.get(name) not in _DEFAULTS:
                raise ConfigError(f"{config_path} sets {name}={raw[name]!r} ({meaning}), which engine_ref does not "
                                  f"support; train the adapter without it.")
        r, alpha, targets = raw.get("r"), raw.get("lora_alpha"), raw.get("target_modules")
        if isinstance(r, bool) or not isinstance(r, int) or r < 1:
            raise ConfigError(f"{config_path} has r={r!r}; the LoRA rank r must be an integer of at least 1.")
        if isinstance(alpha, bool) or not isinstance(alpha, (int, float)):
            raise ConfigError(f"{config_path} has lora_alpha={alpha!r}; it must be a number (PEFT's default is 8).")
        if not isinstance(targets, list) or not targets or not all(isinstance(t, str) for t in targets):
            raise ConfigError(
                f"{config_path} has target_modules={targets!r}; engine_ref needs a list of module names such as "
                f"[\"q_proj\", \"v_proj\"] (a regular expression or 'all-linear' is not supported).")
        base = raw.get("base_model_name_or_path")
        return cls(r, float(alpha), targets, str(base) if base else None, bool(raw.get("use_rslora", False)), path)

    def validate_legal(self, lora_config: LoRAConfig, base_model: str, supported_modules: Collection[str]) -> None:
        """Raise ConfigError unless the engine can run this adapter: rank, base model, target modules."""
        if self.r > lora_config.max_lora_rank:
            raise ConfigError(
                f"adapter {self.path} has r={self.r}, above max_lora_rank={lora_config.max_lora_rank}; start the "
                f"engine with max_lora_rank={self.r} (--max-lora-rank {self.r}) or more.")
        if self.base_model_name_or_path is not None and not same_model(self.base_model_name_or_path, base_model):
            raise ConfigError(
                f"adapter {self.path} was trained for base model {self.base_model_name_or_path!r} "
                f"(base_model_name_or_path in {ADAPTER_CONFIG}), but the engine runs {base_model!r}; use an adapter "
                f"for this model, or correct base_model_name_or_path if it names this model another way.")
        unsupported = [t for t in self.target_modules
                       if not any(module == t or module.endswith("." + t) for module in supported_modules)]
        if unsupported:
            raise ConfigError(
                f"adapter {self.path} targets {unsupported}, which this model cannot run LoRA on; it supports "
                f"{short_module_names(supported_modules)}. Train the adapter on those modules only.")


def short_module_names(modules: Collection[str]) -> list[str]:
    """The last parts of module names (``q_proj`` of ``model.layers.0.self_attn.q_proj``), sorted, once each."""
    return sorted({name.rsplit(".", 1)[-1] for name in modules})


def same_model(adapter_base: str, model: str) -> bool:
    """Whether two model names mean the same model: equal, the same directory, or the same last path part
    (a hub name such as ``org/Model`` and a local copy in ``.../Model``)."""
    if adapter_base == model:
        return True
    a, b = Path(adapter_base), Path(model)
    if a.exists() and b.exists():
        return a.resolve() == b.resolve()
    return a.name == b.name
