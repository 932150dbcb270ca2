"""SchedulerConfig: how many tokens and sequences one step may batch."""

from __future__ import annotations

from dataclasses import dataclass

from engine_ref.config.utils import MAX_TOKENS_LIMIT, positive_int
from engine_ref.errors import ConfigError
from engine_ref.kv_cache.sizing import default_max_num_batched_tokens


@dataclass(init=False)
class SchedulerConfig:
    """Batch limits: tokens per step (also the profile run's size) and sequences per step.

    ``max_num_batched_tokens=None`` means ``default_max_num_batched_tokens(max_model_len)``; either way
    a full-length prompt must fit one step. Once built, it is always set.
    """

    max_num_batched_tokens: int
    max_num_seqs: int

    def __init__(self, max_model_len: int, max_num_batched_tokens: int | None = None, max_num_seqs: int = 64) -> None:
        if max_num_batched_tokens is None:
            max_num_batched_tokens = default_max_num_batched_tokens(max_model_len)
        positive_int("max_num_batched_tokens", max_num_batched_tokens, MAX_TOKENS_LIMIT)
        positive_int("max_num_seqs", max_num_seqs)
        if max_num_batched_tokens < max_model_len:
            raise ConfigError(
                f"max_num_batched_tokens={max_num_batched_tokens} is smaller than max_model_len="
                f"{max_model_len}, so a full-length prompt could never be scheduled; raise "
                f"max_num_batched_tokens to at least {max_model_len} or lower max_model_len."
            )
        self.max_num_batched_tokens, self.max_num_seqs = max_num_batched_tokens, max_num_seqs
