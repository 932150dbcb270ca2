"""run_multirank: a function on N real ranks (warm child processes) joined in a gloo process group.

Each rank also gets engine_ref's tensor-parallel group, so ``fn`` can build and run TP layers.
A rank that raises fails the whole call with that rank's own traceback; a hang past the timeout
has every pending rank's Python stacks dumped before all ranks are killed.
"""

from __future__ import annotations

import multiprocessing.connection
import shutil
import tempfile
import time
import traceback
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any


class MultirankError(Exception):
    """A rank raised, died or hung; the message carries its traceback, signal or stacks."""


def _rank_main(payload: bytes, rank: int, world_size: int, init_method: str, conn: Connection) -> None:
    import cloudpickle

    from engine_ref.distributed.parallel_state import destroy_distributed_environment, init_distributed_environment

    try:
        init_distributed_environment(world_size, rank, init_method, "gloo")
        fn, args, kwargs = cloudpickle.loads(payload)
        conn.send_bytes(cloudpickle.dumps(("ok", fn(rank, world_size, *args, **kwargs))))
    except BaseException:  # noqa: BLE001 - reported to the parent
        conn.send_bytes(cloudpickle.dumps(("error", traceback.format_exc())))
    finally:
        destroy_distributed_environment()


def run_multirank(fn: Callable[..., Any], world_size: int = 2, *args: Any, timeout: float = 60.0,
                  **kwargs: Any) -> list[Any]:
    """Run ``fn(rank, world_size, *args, **kwargs)`` on ``world_size`` ranks; return results by rank."""
    import cloudpickle

    from engine_ref.isolation import describe_exitcode, get_mp_context, start_process

    if world_size < 1:
        raise ValueError(f"world_size={world_size} must be at least 1")
    ctx = get_mp_context()
    # A file store in a private directory: unlike a probed free port, no other group can take it.
    store_dir = tempfile.mkdtemp(prefix="enginecheck-multirank-")
    init_method = f"file://{store_dir}/store"
    payload = cloudpickle.dumps((fn, args, kwargs))
    ranks = []
    try:
        for rank in range(world_size):
            reader, writer = ctx.Pipe(duplex=False)
            proc = start_process(_rank_main, payload, rank, world_size, init_method, writer,
                                 name=f"multirank-{rank}", ctx=ctx)
            writer.close()
            ranks.append((rank, proc, reader))
        results: dict[int, Any] = {}
        deadline = time.monotonic() + timeout
        while len(results) < world_size:
            pending = [(r, p, c) for r, p, c in ranks if r not in results]
            ready = multiprocessing.connection.wait([c for _, _, c in pending] + [p.sentinel for _, p, _ in pending],
                                                    timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                stacks = "\n".join(f"--- rank {r} ---\n{p.dump_stacks()}" for r, p, _ in pending)
                raise MultirankError(
                    f"rank(s) {[r for r, _, _ in pending]} of {world_size} did not finish within {timeout:g} s "
                    f"and were killed. Their Python stacks:\n{stacks}")
            for rank, proc, conn in pending:
                if conn.poll():
                    try:
                        status, value = cloudpickle.loads(conn.recv_bytes())
                    except EOFError:
                        proc.join(5)
                        raise MultirankError(f"rank {rank} of {world_size} {describe_exitcode(proc.exitcode)}") from None
                    if status == "error":
                        raise MultirankError(f"rank {rank} of {world_size} failed:\n{value}")
                    results[rank] = value
                elif proc.sentinel in ready:
                    proc.join(5)
                    raise MultirankError(f"rank {rank} of {world_size} {describe_exitcode(proc.exitcode)} "
                                         f"before returning a result")
        return [results[rank] for rank in range(world_size)]
    except BaseException:
        for _, proc, _ in ranks:  # the others may wait forever in a collective with the failed rank
            proc.kill_tree()
        raise
    finally:
        for _, proc, conn in ranks:
            conn.close()
            proc.close(grace_s=5.0)
        shutil.rmtree(store_dir, ignore_errors=True)
