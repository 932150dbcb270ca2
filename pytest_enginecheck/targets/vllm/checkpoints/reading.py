"""What the writers and the engine read back from a written tiny checkpoint.
"""

from __future__ import annotations

import os
from typing import Any


def vocab_size(ckpt: str) -> int:
    """The checkpoint's vocab_size: its config.json's top-level one, else the smallest of its sub-configs' (a
    composite config's ``text_config``, BagelConfig's ``llm_config``), which every prompt token then lies inside."""
    import json

    with open(os.path.join(ckpt, "config.json")) as f:
        config = json.load(f)
    return int(config.get("vocab_size") or min(_nested_vocab_sizes(config)))


def special_ids(ckpt: str) -> set[int]:
    """The token ids the checkpoint's config.json gives a role (``pytest_enginecheck.prompts.special_token_ids``:
    image placeholders, bos, eos, pad), which no prompt holds."""
    import json

    from pytest_enginecheck.prompts import special_token_ids

    with open(os.path.join(ckpt, "config.json")) as f:
        return special_token_ids(json.load(f))


def _nested_vocab_sizes(config: dict[str, Any]) -> list[int]:
    """The ``vocab_size`` of every dict inside ``config``, at any depth."""
    found = []
    for value in config.values():
        if isinstance(value, dict):
            found += [value["vocab_size"]] if isinstance(value.get("vocab_size"), int) else []
            found += _nested_vocab_sizes(value)
    return found
