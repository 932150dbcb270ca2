"""LoadConfig: how weights are read."""

from __future__ import annotations

from dataclasses import dataclass

from engine_ref.errors import ConfigError

LOAD_FORMATS = ("safetensors", "dummy", "pt")


@dataclass
class LoadConfig:
    """How weights are read: safetensors (HF layout), dummy (random, no files) or pt (weights_only)."""

    load_format: str = "safetensors"

    def __post_init__(self) -> None:
        if self.load_format not in LOAD_FORMATS:
            raise ConfigError(f"load_format={self.load_format!r} is unknown; use one of {', '.join(LOAD_FORMATS)}.")
