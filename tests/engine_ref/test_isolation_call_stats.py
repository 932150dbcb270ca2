"""run_isolated measures its own overhead: the child's start and answer time and the payload bytes each way
(``last_call_stats``), for a value, an exception and a crash alike."""

from __future__ import annotations

import os
import threading

import pytest

from engine_ref.isolation import CallStats, ProcessCrashedError, last_call_stats, run_isolated

BIG = 200_000  # bytes: far above the pickled function and the answer's envelope


def echo_size(data: bytes) -> int:
    return len(data)


def big_answer(n: int) -> bytes:
    return b"y" * n


def raises() -> None:
    raise ValueError("from the child")


def exits() -> None:
    os._exit(3)


def test_stats_of_a_call_that_returns() -> None:
    assert run_isolated(echo_size, b"x" * BIG) == BIG
    stats = last_call_stats()
    assert isinstance(stats, CallStats)
    assert BIG < stats.sent_bytes < BIG + 2_000 and stats.received_bytes is not None and stats.received_bytes < 500
    assert stats.start_s is not None and stats.answer_s is not None
    assert 0 < stats.start_s < stats.total_s and 0 <= stats.answer_s < stats.total_s
    assert stats.start_s + stats.answer_s < stats.total_s

    run_isolated(big_answer, BIG)
    stats = last_call_stats()
    assert stats is not None and stats.sent_bytes < 2_000 and stats.received_bytes is not None
    assert BIG < stats.received_bytes < BIG + 2_000


def test_stats_of_a_call_that_raises_or_crashes() -> None:
    with pytest.raises(ValueError, match="from the child"):
        run_isolated(raises)
    stats = last_call_stats()
    assert stats is not None and stats.received_bytes and stats.start_s is not None and stats.answer_s is not None

    with pytest.raises(ProcessCrashedError, match="exited with code 3"):
        run_isolated(exits)
    stats = last_call_stats()
    assert stats is not None and stats.sent_bytes > 0 and stats.total_s > 0
    assert (stats.received_bytes, stats.start_s, stats.answer_s) == (None, None, None)  # it never answered


def test_stats_are_per_thread() -> None:
    run_isolated(echo_size, b"x" * BIG)
    seen: list[CallStats | None] = []
    thread = threading.Thread(target=lambda: seen.append(last_call_stats()))
    thread.start()
    thread.join(10)
    assert seen == [None]
    stats = last_call_stats()
    assert stats is not None and stats.sent_bytes > BIG
