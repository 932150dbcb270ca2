"""run_isolated: call a function in a warm child and get back its value, its exception or its crash.

Each call also measures its own overhead (``CallStats``, read with ``last_call_stats``): how long the
child took to start (from the request to its first instruction), how long its answer took to come
back (from the function's return to the value unpickled here), and the cloudpickle bytes each way.
"""

from __future__ import annotations

import dataclasses
import multiprocessing.connection
import os
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

from engine_ref.isolation.answer import ERROR, OK, Answer, Failure
from engine_ref.isolation.context import get_mp_context
from engine_ref.isolation.errors import ProcessCrashedError, ProcessTimeoutError, RemoteError, describe_exitcode, tail
from engine_ref.isolation.process import child_started_at, start_process
from engine_ref.isolation.wait import AnswerWait, Deadline


@dataclass(frozen=True)
class CallStats:
    """The overhead of one ``run_isolated`` call, around the function itself.

    ``start_s``: from asking for the child to its first instruction (the fork and multiprocessing's own
    start-up, under forkserver the request to the server too); ``answer_s``: from the function's return
    in the child to its value (or exception) unpickled here; ``sent_bytes`` / ``received_bytes``: the
    cloudpickle payloads of the call and of its answer. The timings and ``received_bytes`` are None when
    the child never answered (it crashed or hung).
    """

    sent_bytes: int
    received_bytes: int | None = None
    start_s: float | None = None
    answer_s: float | None = None
    total_s: float = 0.0  # the whole call, as its caller waited for it


_last = threading.local()


def last_call_stats() -> CallStats | None:
    """The CallStats of this thread's latest ``run_isolated`` call (also when it raised); None before any."""
    return getattr(_last, "stats", None)


def _run_and_send(payload: bytes, result_w: Connection, output_w: Connection) -> None:
    import cloudpickle

    os.dup2(output_w.fileno(), 1)
    os.dup2(output_w.fileno(), 2)
    output_w.close()
    answer: Answer
    try:
        fn, args, kwargs = cloudpickle.loads(payload)
        value = fn(*args, **kwargs)
        returned = time.monotonic()
    except SystemExit as e:  # the child asked to exit: the parent sees an exit code, as for any process
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(e.code if isinstance(e.code, int) else 1)
    except BaseException as e:  # noqa: BLE001 - everything else goes back to the parent
        returned = time.monotonic()
        answer = (ERROR, Failure.capture(e, keep_exception=True))
    else:
        try:
            answer = (OK, cloudpickle.dumps(value))
        except Exception:  # noqa: BLE001
            message = f"the return value of type {type(value).__name__} cannot be pickled"
            answer = (ERROR, Failure("TypeError", message, f"TypeError: {message}\n"))
    result_w.send_bytes(cloudpickle.dumps((answer, child_started_at(), returned)))
    result_w.close()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_isolated(fn: Callable[..., Any], *args: Any, timeout: float | None = None,
                 name: str | None = None, **kwargs: Any) -> Any:
    """Run ``fn(*args, **kwargs)`` in a warm child and return its value.

    The function and its arguments travel with cloudpickle. An exception in the child is re-raised
    here as itself, with the child's traceback as ``__cause__`` (a RemoteTraceback). A child that
    dies raises ProcessCrashedError; one that outlives ``timeout`` has its stacks dumped, its whole
    process tree killed, and raises ProcessTimeoutError. Nothing it started outlives the call. What
    the child prints (stdout and stderr, from any library) is written to this process's stderr,
    where pytest captures it with the test.
    """
    import cloudpickle

    requested = time.monotonic()
    _last.stats = None
    ctx = get_mp_context()
    result_r, result_w = ctx.Pipe(duplex=False)
    output_r, output_w = ctx.Pipe(duplex=False)
    label = name or getattr(fn, "__qualname__", "function")
    payload = cloudpickle.dumps((fn, args, kwargs))
    _last.stats = CallStats(len(payload))
    child = start_process(_run_and_send, payload, result_w, output_w, name=f"isolated:{label}", ctx=ctx)
    result_w.close()
    output_w.close()
    output = bytearray()

    def read_chunk() -> bool:
        """Keep what the child printed so far; False at EOF."""
        chunk = os.read(output_r.fileno(), 65536)
        output.extend(chunk)
        return bool(chunk)

    def read_output(block_s: float) -> None:
        while multiprocessing.connection.wait([output_r], timeout=block_s) and read_chunk():
            block_s = 0

    try:
        wait = AnswerWait({label: result_r}, {label: child.sentinel}, Deadline(timeout), drains={output_r: read_chunk})
        answers = dict(wait)
        if wait.pending:
            stacks = child.dump_stacks()
            child.kill_tree()
            read_output(0.1)
            raise ProcessTimeoutError(f"{label} did not finish within {timeout:g} s and was killed. "
                                      f"Its Python stacks at that moment:\n{stacks or '(none could be read)'}",
                                      stacks, output.decode(errors="replace"))
        data = answers[label]
        if data is None:  # the child ended without a result
            child.join(5)
            read_output(0.1)
            text = output.decode(errors="replace")
            raise ProcessCrashedError(f"{label} {describe_exitcode(child.exitcode)} before returning a result."
                                      + (f" Its last output:\n{tail(text)}" if text.strip() else ""),
                                      child.exitcode, text)
        answer, started, returned = cloudpickle.loads(data)
        try:
            return _unpack(answer, output.decode(errors="replace"))
        finally:
            _last.stats = CallStats(len(payload), len(data), None if started is None else started - requested,
                                    time.monotonic() - returned)
    finally:
        result_r.close()
        child.close(grace_s=5.0)
        read_output(0)
        output_r.close()
        if output:
            sys.stderr.write(output.decode(errors="replace"))
            sys.stderr.flush()
        _last.stats = dataclasses.replace(_last.stats, total_s=time.monotonic() - requested)


def _unpack(answer: Answer, output: str) -> Any:
    """The child's value, or its exception raised here (as itself when it unpickles)."""
    import cloudpickle

    status, payload = answer
    if status == OK:
        return cloudpickle.loads(payload)
    failure: Failure = payload
    try:
        exc = cloudpickle.loads(failure.exception) if failure.exception is not None else None
    except Exception:  # noqa: BLE001 - e.g. an __init__ that takes other arguments than it passes up
        exc = None
    if not isinstance(exc, BaseException):
        raise RemoteError(failure.type_name, failure.message, failure.traceback, output)
    raise exc from failure.remote_traceback()
