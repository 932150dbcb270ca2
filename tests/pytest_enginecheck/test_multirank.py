"""run_multirank's ranks exit as soon as they answered, as run_isolated's children do."""

from __future__ import annotations

import threading
import time

from pytest_enginecheck.multirank import CLOSE_GRACE_S, run_multirank


def _leave_a_thread(rank: int, world_size: int) -> tuple[int, float]:
    threading.Thread(target=time.sleep, args=(600,), name=f"left-by-rank-{rank}").start()  # non-daemon
    return rank, time.monotonic()


def test_a_thread_the_function_leaves_does_not_hold_the_call_for_the_grace() -> None:
    """Before, a rank that answered stayed alive for as long as a non-daemon thread ran (a planted poller thread
    made every hooked forward of the load check wait out the grace); the thread also ends with the rank."""
    answers = run_multirank(_leave_a_thread, 2, timeout=120)
    after_return = time.monotonic() - max(returned for _, returned in answers)  # one clock for the whole host
    assert [rank for rank, _ in answers] == [0, 1]
    assert after_return < CLOSE_GRACE_S, after_return
