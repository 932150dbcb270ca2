"""What the config classes share: the largest token count engine_ref accepts, and the positive-integer check."""

from __future__ import annotations

from typing import Any

from engine_ref.errors import ConfigError

#: The most tokens a context (max_model_len, max_position_embeddings) or a batch may hold: above any published model.
MAX_TOKENS_LIMIT = 2**24


def positive_int(name: str, value: Any, limit: int | None = None) -> None:
    """Raise ConfigError unless ``value`` is a positive integer (a bool is not one), at most ``limit``."""
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConfigError(f"{name}={value!r} must be a positive integer.")
    if limit is not None and value > limit:
        raise ConfigError(f"{name}={value} is larger than engine_ref supports (at most {limit}); lower it.")
