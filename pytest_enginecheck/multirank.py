"""run_multirank: a function on N real ranks (warm child processes) joined in a gloo process group.

Each rank also gets engine_ref's tensor-parallel group, so ``fn`` can build and run TP layers.
A rank that raises fails the whole call with that rank's own traceback; a hang past the timeout
has every pending rank's Python stacks dumped before all ranks are killed.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import sys
import tempfile
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from engine_ref.isolation import WarmProcess


CLOSE_GRACE_S = 5.0  # what a rank gets to exit by itself once the call is over, before it is killed


class MultirankError(Exception):
    """A rank raised, died or hung; the message carries its traceback, signal or stacks."""


def _rank_main(payload: bytes, rank: int, world_size: int, init_method: str, conn: Connection) -> None:
    import cloudpickle
    import torch.distributed

    from engine_ref.distributed.parallel_state import destroy_distributed_environment, init_distributed_environment
    from engine_ref.isolation import ERROR, OK, Failure

    answered = False
    try:
        init_distributed_environment(world_size, rank, init_method, "gloo")
        fn, args, kwargs = cloudpickle.loads(payload)
        conn.send_bytes(cloudpickle.dumps((OK, fn(rank, world_size, *args, **kwargs))))
        answered = True
    except BaseException as e:  # noqa: BLE001 - reported to the parent
        conn.send_bytes(cloudpickle.dumps((ERROR, Failure.capture(e))))
    try:
        if answered:
            # No rank leaves before every rank answered: one that exits closes its connections, which fails a peer
            # still setting up its process groups with it ("Connection closed by peer"). A peer that failed
            # instead is what the caller reports; this rank's barrier then fails or waits to be killed.
            with contextlib.suppress(Exception):
                torch.distributed.barrier()
    finally:
        destroy_distributed_environment()
    # Then exit at once, as run_isolated's children do: a thread the function left running (a model's poller)
    # would otherwise keep the rank alive until the caller's grace ran out.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_multirank(fn: Callable[..., Any], world_size: int = 2, *args: Any, timeout: float = 60.0,
                  **kwargs: Any) -> list[Any]:
    """Run ``fn(rank, world_size, *args, **kwargs)`` on ``world_size`` ranks; return results by rank."""
    import cloudpickle

    from engine_ref.isolation import ERROR, AnswerWait, Deadline, describe_exitcode, get_mp_context, start_process
    from engine_ref.isolation.tempdirs import owner_dir

    if world_size < 1:
        raise ValueError(f"world_size={world_size} must be at least 1")
    ctx = get_mp_context()
    # A file store in a private directory: unlike a probed free port, no other group can take it.
    store_dir = tempfile.mkdtemp(prefix="multirank-", dir=owner_dir())  # swept with it if this process is killed
    init_method = f"file://{store_dir}/store"
    payload = cloudpickle.dumps((fn, args, kwargs))
    procs: dict[int, WarmProcess] = {}
    conns: dict[int, Connection] = {}
    try:
        for rank in range(world_size):
            conns[rank], writer = ctx.Pipe(duplex=False)
            procs[rank] = start_process(_rank_main, payload, rank, world_size, init_method, writer,
                                        name=f"multirank-{rank}", ctx=ctx)
            writer.close()
        results: dict[int, Any] = {}
        wait = AnswerWait(conns, {rank: proc.sentinel for rank, proc in procs.items()}, Deadline(timeout))
        for rank, message in wait:
            if message is None:
                procs[rank].join(5)
                raise MultirankError(f"rank {rank} of {world_size} {describe_exitcode(procs[rank].exitcode)} "
                                     f"before returning a result")
            status, value = cloudpickle.loads(message)
            if status == ERROR:
                raise MultirankError(f"rank {rank} of {world_size} failed:\n{value.traceback}")
            results[rank] = value
        if wait.pending:
            stacks = "\n".join(f"--- rank {rank} ---\n{procs[rank].dump_stacks()}" for rank in wait.pending)
            raise MultirankError(
                f"rank(s) {list(wait.pending)} of {world_size} did not finish within {timeout:g} s "
                f"and were killed. Their Python stacks:\n{stacks}")
        return [results[rank] for rank in range(world_size)]
    except BaseException:
        for proc in procs.values():  # the others may wait forever in a collective with the failed rank
            proc.kill_tree()
        raise
    finally:
        for conn in conns.values():
            conn.close()
        for proc in procs.values():
            proc.close(grace_s=CLOSE_GRACE_S)
        shutil.rmtree(store_dir, ignore_errors=True)
