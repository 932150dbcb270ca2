"""How an engine's file-backed ModelInfo cache served one lookup, told from the outside by its file.

For an engine whose registry does not count its own cache hits (vLLM's ``modelinfos``: one JSON file per
model class, ``{"hash": <source hash>, "modelinfo": {...}}``, rewritten after each inspection), the
file before and after the lookup says what happened, without touching the engine's internals:

- absent before, written during: ``missing``; absent before and after: ``no_source`` (nothing to hash,
  so nothing is cached);
- present and left alone: ``disk`` (served from it);
- present and rewritten: ``source_changed`` when the stored hash changed, ``corrupt`` when the old file
  could not be read or held the same hash (the engine could not use it).

The outcomes are engine_ref's registry's names (``report.CACHE_OUTCOMES``), so both targets' counts sum alike.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

UNREADABLE = object()  # the file's content before the lookup could not be parsed


@dataclass
class CacheObservation:
    """The outcome of the lookup made inside ``observe_cache_file``'s block (set when the block ends)."""

    path: Path
    outcome: str | None = None  # a CACHE_OUTCOMES name; None while the block runs or when it raised

    def counts(self) -> dict[str, int]:
        """``{outcome: 1}`` for a result's ``detail["cache"]``; empty when there is no outcome."""
        return {self.outcome: 1} if self.outcome else {}


def _state(path: Path) -> tuple[int, int, int] | None:
    """The file's identity (inode, mtime, size): a rewrite (even by rename, with the same bytes) changes it."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return None
    return st.st_ino, st.st_mtime_ns, st.st_size


def _stored_hash(path: Path, hash_key: str) -> Any:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        return data[hash_key] if isinstance(data, dict) and isinstance(data.get(hash_key), str) else UNREADABLE
    except (OSError, ValueError):
        return UNREADABLE


@contextmanager
def observe_cache_file(path: str | Path, hash_key: str = "hash") -> Iterator[CacheObservation]:
    """Classify the one cache lookup made in the block by what happened to its file ``path``.

    ``hash_key``: the key under which the file stores the source hash it was written for.
    """
    observation = CacheObservation(Path(path))
    before = _state(observation.path)
    stored = _stored_hash(observation.path, hash_key) if before is not None else None
    yield observation
    after = _state(observation.path)
    if before is None:
        observation.outcome = "missing" if after is not None else "no_source"
    elif after == before:
        observation.outcome = "disk"
    elif stored is UNREADABLE or stored == _stored_hash(observation.path, hash_key):
        observation.outcome = "corrupt"
    else:
        observation.outcome = "source_changed"
