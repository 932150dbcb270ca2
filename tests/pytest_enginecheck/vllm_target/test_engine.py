"""The vLLM target's engine room without vLLM: the ranks' one deadline wait (real forked rank processes, no engine
in them), their shared memory and machine lock, a rank's trimmed log, and the MLA verdict that picks the dtype."""

from __future__ import annotations

import multiprocessing
import os
import sys
import time
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import pytest

# --- engine: the ranks' one deadline wait (real forked processes, no vLLM in them) ---------------------------

def _answer(conn: Connection) -> None:
    import cloudpickle

    from pytest_enginecheck.targets.vllm.engine.drive import EngineRun

    conn.send_bytes(cloudpickle.dumps(("ok", EngineRun(2, "warm", [[1, 2]], [{"rank": 0}]))))


def _answer_then_linger(conn: Connection) -> None:
    _answer(conn)
    time.sleep(3600)  # e.g. a non-daemon thread of the engine that keeps its rank alive


def _hang_in(conn: Connection) -> None:
    def waiting_for_its_peer() -> None:
        time.sleep(3600)

    waiting_for_its_peer()


def _die(conn: Connection) -> None:
    os._exit(3)


def _fail(conn: Connection) -> None:
    import cloudpickle

    from pytest_enginecheck.targets.vllm.failures import EngineFailure

    conn.send_bytes(cloudpickle.dumps(("error", EngineFailure("load_model", 1, "ValueError: x", "", ""), "x")))


def _wait(*targets: Any, timeout: float, grace_s: float | None = None) -> tuple[Any, float, float]:
    """Start one process per target as the engine starts its ranks, wait for them and close them as it does:
    (what the wait returned or raised, its seconds, the seconds closing the ranks took). None is left running."""
    from engine_ref.isolation import AnswerWait, Deadline, start_process
    from pytest_enginecheck.targets.vllm.engine.ranks import SHUTDOWN_GRACE_S, _close_ranks, _gather

    ctx = multiprocessing.get_context("fork")
    procs, readers = {}, {}
    for rank, target in enumerate(targets):
        readers[rank], writer = ctx.Pipe(duplex=False)
        procs[rank] = start_process(target, writer, name=f"rank-{rank}", ctx=ctx)
        writer.close()
    pids = [p.pid for p in procs.values()]
    started = time.monotonic()
    try:
        outcome: Any = _gather(AnswerWait(readers, {r: p.sentinel for r, p in procs.items()}, Deadline(timeout)),
                               procs, timeout)
    except Exception as e:  # noqa: BLE001 - the outcome under test
        outcome = e
    waited = time.monotonic() - started
    _close_ranks(procs, Deadline(SHUTDOWN_GRACE_S if grace_s is None else grace_s))
    closed = time.monotonic() - started - waited
    for reader in readers.values():
        reader.close()
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    return outcome, waited, closed


def test_every_pending_ranks_stacks_at_the_deadline_and_one_bounded_shutdown() -> None:
    from pytest_enginecheck.targets.vllm.engine.drive import EngineStartError

    error, waited, closed = _wait(_answer, _hang_in, _hang_in, timeout=2.0)
    assert isinstance(error, EngineStartError), error
    assert error.failure.phase == "timeout" and error.failure.rank == 1
    assert str(error).startswith("rank 1, 2 did not finish within 2 s; their Python stacks at that moment:")
    for rank in (1, 2):
        stack = str(error).split(f"rank {rank}:\n", 1)[1]
        assert "in waiting_for_its_peer" in stack.split("rank 2:\n")[0]
    assert waited < 2.0 + 2 * 1.5, waited  # the deadline, then each pending rank's stacks (~1 s each at most)
    assert closed < 1.0, closed  # the hung ranks were killed with their stacks: no grace spent on them


def test_a_rank_that_dies_is_named_with_its_exit_and_its_hung_peer_costs_no_grace() -> None:
    from pytest_enginecheck.targets.vllm.engine.drive import EngineStartError
    from pytest_enginecheck.targets.vllm.engine.ranks import FAILURE_GRACE_S

    error, waited, closed = _wait(_hang_in, _die, timeout=60.0)
    assert isinstance(error, EngineStartError), error
    assert str(error) == "rank 1 exited with code 3 before returning a result"
    assert (error.failure.phase, error.failure.rank) == ("startup", 1)
    assert waited < FAILURE_GRACE_S + 5.0, waited
    assert closed < 1.0, closed


def test_a_death_is_the_cause_over_the_error_its_peer_raises_after_it() -> None:
    from pytest_enginecheck.targets.vllm.engine.drive import EngineStartError

    error, _, _ = _wait(_fail, _die, timeout=60.0)
    assert isinstance(error, EngineStartError) and "rank 1 exited with code 3" in str(error), error
    error, _, _ = _wait(_answer, _fail, timeout=60.0)
    assert isinstance(error, EngineStartError) and error.failure.phase == "load_model", error


def test_ranks_that_linger_after_answering_share_one_grace() -> None:
    runs, _, closed = _wait(_answer_then_linger, _answer_then_linger, _answer_then_linger, timeout=60.0, grace_s=1.0)
    assert len(runs) == 3
    assert 1.0 <= closed < 2.0, closed  # one grace for the three of them, not one each


def test_ranks_that_answer_are_gathered_in_rank_order() -> None:
    runs, _, closed = _wait(_answer, _answer, timeout=60.0)
    assert [r.tokens for r in runs] == [[[1, 2]], [[1, 2]]]
    assert closed < 5.0, closed


@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="no /dev/shm here")
def test_the_all_reduce_segments_a_rank_left_are_unlinked_unless_someone_holds_them() -> None:
    from pytest_enginecheck.targets.vllm.engine.ranks import SHM_DIR, _remove_left_shm, _shm_entries

    before = _shm_entries()
    tag = f"enginecheck-test-{os.getpid()}"
    left, held, other = (os.path.join(SHM_DIR, f"{tag}-{n}") for n in ("tp:0-[0-1]-cpushm_1", "tp:0-[0-1]-cpushm_0",
                                                                        "not-vllms"))
    for path in (left, held, other):
        Path(path).write_bytes(b"x")
    try:
        with open(held, "rb"):  # a running engine's segment (here: open in this process)
            _remove_left_shm(before)
            assert (os.path.exists(left), os.path.exists(held), os.path.exists(other)) == (False, True, True)
    finally:
        for path in (left, held, other):
            if os.path.exists(path):
                os.unlink(path)


def test_multirank_engines_take_turns_on_the_machine_lock(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two TP>1 engines at once would collide on vLLM's rank-named shared memory: the second waits for the lock, and
    fails naming it when the first holds it past its deadline. (A lock of its own: a real engine may hold the
    machine's now.)"""
    import fcntl
    import os

    from engine_ref.isolation import Deadline
    from pytest_enginecheck.targets.vllm.engine import ranks
    from pytest_enginecheck.targets.vllm.engine.drive import EngineStartError
    from pytest_enginecheck.targets.vllm.engine.ranks import _one_multirank_engine_at_a_time

    MULTIRANK_LOCK = str(tmp_path / "multirank.lock")
    monkeypatch.setattr(ranks, "MULTIRANK_LOCK", MULTIRANK_LOCK)

    with _one_multirank_engine_at_a_time(Deadline(1.0)):
        other = os.open(MULTIRANK_LOCK, os.O_RDWR)
        try:
            with pytest.raises(BlockingIOError):
                fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)  # held
        finally:
            os.close(other)
    holder = os.open(MULTIRANK_LOCK, os.O_RDWR)
    fcntl.flock(holder, fcntl.LOCK_EX)
    try:
        with (pytest.raises(EngineStartError, match="another vLLM engine of tensor_parallel_size>1 ran on"),
              _one_multirank_engine_at_a_time(Deadline(0.2))):
            pass
    finally:
        os.close(holder)
    with _one_multirank_engine_at_a_time(Deadline(0.2)):  # free again
        pass


# --- ranklog: a rank's output, trimmed to what is about the outcome --------------------------------------------

RANK_OUTPUT = """\
(vllm-rank-0 pid=7) INFO 12-02 01:48:07 [model.py:733] Resolved architecture: EctpBadShardForCausalLM
(vllm-rank-0 pid=7) WARNING 12-02 01:48:07 [cpu.py:224] Triton is not installed. triton-cpu is expected on x86 CPUs.
(vllm-rank-0 pid=7) WARNING 12-02 01:48:11 [base.py:380] Chat template warmup failed
(vllm-rank-0 pid=7) WARNING 12-02 01:48:11 [base.py:380] Traceback (most recent call last):
(vllm-rank-0 pid=7) WARNING 12-02 01:48:11 [base.py:380] ValueError: Tokenizer not available
(vllm-rank-0 pid=7) WARNING 12-02 01:48:11 [cpu_worker.py:140] CPU backend doesn't allow to use `torch.set_num_threads`
(vllm-rank-0 pid=7) ERROR 12-02 01:48:12 [core.py:9] EngineCore failed to start.
(vllm-rank-0 pid=7) ERROR 12-02 01:48:12 [core.py:9] RuntimeError: shape mismatch
Fatal Python error: Segmentation fault
(vllm-rank-0 pid=7) WARNING 12-02 01:48:09 [cpu_worker.py:51] Node 0 is not in available memory nodes [1].
/venv/lib/python3.12/site-packages/torch/cuda/__init__.py:61: FutureWarning: The pynvml package is deprecated.
  import pynvml  # type: ignore[import]
Loading safetensors checkpoint shards: 100% Completed | 1/1 [00:00<00:00, 61.20it/s]

"""


def test_a_rank_that_failed_keeps_its_warnings_and_errors_without_vllms_noise() -> None:
    from pytest_enginecheck.targets.vllm.engine.ranklog import trimmed_log

    lines = RANK_OUTPUT.splitlines()
    assert trimmed_log(RANK_OUTPUT, failed=True, label="vllm-rank-0").splitlines() == [
        lines[1], lines[6], lines[7], lines[8],
        "(enginecheck: 9 lines of vllm-rank-0's output (vLLM's log not about this outcome, warnings, progress bars, "
        "known noise) left out; ENGINECHECK_FULL_OUTPUT=1 shows them)"]


def test_a_rank_that_answered_keeps_only_its_errors_and_full_keeps_everything(monkeypatch: pytest.MonkeyPatch) -> None:
    from pytest_enginecheck.targets.vllm.engine.ranklog import trimmed_log

    lines = RANK_OUTPUT.splitlines()
    assert trimmed_log(RANK_OUTPUT, failed=False).splitlines()[:3] == [lines[6], lines[7], lines[8]]
    assert "Chat template" not in trimmed_log(RANK_OUTPUT, failed=False)
    assert trimmed_log("", failed=False) == ""
    monkeypatch.setenv("ENGINECHECK_FULL_OUTPUT", "1")
    assert trimmed_log(RANK_OUTPUT, failed=False) == RANK_OUTPUT
    monkeypatch.delenv("ENGINECHECK_FULL_OUTPUT")
    monkeypatch.setenv("ENGINECHECK_VLLM_LOG", "full")  # its older name, kept
    assert trimmed_log(RANK_OUTPUT, failed=False) == RANK_OUTPUT


# --- engine.dtype: MLA models run in bfloat16 ---------------------------------------------------------------------

def test_mla_is_vllms_deepseek_mla_verdict_unless_bidirectional_disabled_or_the_transformers_backend() -> None:
    from types import SimpleNamespace

    from pytest_enginecheck.targets.vllm.engine.dtype import uses_mla

    mla = SimpleNamespace(model_type="deepseek_v2", kv_lora_rank=8)
    assert uses_mla(mla, True)
    assert not uses_mla(mla, False)  # vLLM's convertor said no (kv_lora_rank None, a model type not in its list)
    assert not uses_mla(SimpleNamespace(model_type="deepseek_v2", kv_lora_rank=8, is_causal=False), True)
    assert not uses_mla(mla, True, mla_disabled=True)  # VLLM_MLA_DISABLE
    # vLLM's Transformers backend decides by kv_lora_rank alone, whatever the convertor says
    assert uses_mla(mla, False, transformers_backend=True)
    assert not uses_mla(SimpleNamespace(model_type="llama"), True, transformers_backend=True)


def test_a_model_refers_to_mla_through_its_own_module_or_a_base_class_module() -> None:
    import types

    from pytest_enginecheck.targets.vllm.engine.dtype import refers_to_mla

    base_module = types.ModuleType("enginecheck_mla_base")
    base_module.MultiHeadLatentAttentionWrapper = object  # type: ignore[attr-defined]  # imported from vLLM's mla.py
    child_module = types.ModuleType("enginecheck_mla_child")
    base = type("SarvamLike", (), {"__module__": base_module.__name__})
    child = type("Child", (base,), {"__module__": child_module.__name__})
    plain = type("Plain", (), {"__module__": child_module.__name__})
    sys.modules.update({base_module.__name__: base_module, child_module.__name__: child_module})
    try:
        assert refers_to_mla(base) and refers_to_mla(child)  # the base class's module builds the MLA layer
        assert not refers_to_mla(plain)
    finally:
        for name in (base_module.__name__, child_module.__name__):
            sys.modules.pop(name, None)
