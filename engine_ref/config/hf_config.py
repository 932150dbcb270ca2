"""HFConfig: a model's parsed config.json, read as transformers' config classes read it."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any, TypeVar

from engine_ref.errors import ConfigError, MissingConfigField
from engine_ref.utils import read_json

ConfigT = TypeVar("ConfigT", bound=Mapping[str, Any])

CONFIG_JSON_MAX_BYTES = 16 * 1024**2  # published config.json files are a few KiB
CONFIG_JSON_MAX_DEPTH = 32


# transformers' ``attribute_map`` of each bundled model type: an alias config.json may use -> the name
# the config class stores (Qwen3-MoE's Hub files say num_experts, transformers 5 writes
# num_local_experts). tests/test_models_hf.py proves it equals transformers' own.
HF_ATTRIBUTE_MAPS: dict[str, dict[str, str]] = {
    "mixtral": {"num_experts": "num_local_experts"},
    "qwen3_moe": {"num_experts": "num_local_experts"},
    "llava": {"image_token_id": "image_token_index"},
}


class HFConfig(dict):
    """A parsed config.json: a dict whose keys also read as attributes.

    As in transformers' config classes, an alias of the model type's ``HF_ATTRIBUTE_MAPS`` is stored
    under its canonical name and reads under either. A missing key raises MissingConfigField (an
    AttributeError too), so ``getattr(c, k, default)`` works and a model that needs a field gets a
    message naming it.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        for alias, name in self._aliases().items():
            if not super().__contains__(alias):
                continue
            value = super().pop(alias)
            if super().get(name, value) != value:
                raise ConfigError(
                    f"config.json sets both {alias}={value!r} and {name}={super().__getitem__(name)!r}, two "
                    f"spellings of one field; keep one."
                )
            super().__setitem__(name, value)

    def _aliases(self) -> dict[str, str]:
        return HF_ATTRIBUTE_MAPS.get(dict.get(self, "model_type") or "", {})

    def _key(self, name: Any) -> Any:
        return self._aliases().get(name, name)

    def __getitem__(self, name: Any) -> Any:
        return super().__getitem__(self._key(name))

    def __contains__(self, name: object) -> bool:
        return super().__contains__(self._key(name))

    def get(self, name: Any, default: Any = None) -> Any:
        return super().get(self._key(name), default)

    def __getattr__(self, name: str) -> Any:
        try:
            return self[name]
        except KeyError:
            raise MissingConfigField(
                f"config.json has no field {name!r}, which this architecture needs; add it to config.json."
            ) from None

    def __getstate__(self) -> dict:
        return dict(self)

    def __setstate__(self, state: dict) -> None:
        self.update(state)

    @classmethod
    def from_file(cls, path: Path) -> HFConfig:
        """Read a config.json: a JSON object of at most CONFIG_JSON_MAX_BYTES, nested at most CONFIG_JSON_MAX_DEPTH."""
        try:
            config = read_json(path, max_bytes=CONFIG_JSON_MAX_BYTES, max_depth=CONFIG_JSON_MAX_DEPTH,
                               object_hook=cls)
        except ConfigError as e:
            raise ConfigError(f"{path}: {e}") from None
        except (ValueError, OSError) as e:
            raise ConfigError(f"{path} is not valid JSON for a config.json ({e}); fix or regenerate "
                              f"config.json.") from None
        if not isinstance(config, HFConfig):
            raise ConfigError(f"{path} holds a JSON {type(config).__name__}, not an object; config.json must be "
                              f"one JSON object such as {{\"architectures\": [\"LlamaForCausalLM\"], ...}}.")
        return config


def get_text_config(hf_config: ConfigT) -> ConfigT:
    """The language model's config: ``text_config`` for multimodal models, else the config itself."""
    return hf_config.get("text_config") or hf_config
