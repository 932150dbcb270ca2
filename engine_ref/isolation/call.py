"""run_isolated: call a function in a warm child and get back its value, its exception or its crash."""

from __future__ import annotations

import multiprocessing.connection
import os
import sys
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

from engine_ref.isolation.answer import ERROR, OK, Answer, Failure
from engine_ref.isolation.context import get_mp_context
from engine_ref.isolation.errors import ProcessCrashedError, ProcessTimeoutError, RemoteError, describe_exitcode, tail
from engine_ref.isolation.process import start_process
from engine_ref.isolation.wait import AnswerWait, Deadline


def _run_and_send(payload: bytes, result_w: Connection, output_w: Connection) -> None:
    import cloudpickle

    os.dup2(output_w.fileno(), 1)
    os.dup2(output_w.fileno(), 2)
    output_w.close()
    answer: Answer
    try:
        fn, args, kwargs = cloudpickle.loads(payload)
        value = fn(*args, **kwargs)
    except SystemExit as e:  # the child asked to exit: the parent sees an exit code, as for any process
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(e.code if isinstance(e.code, int) else 1)
    except BaseException as e:  # noqa: BLE001 - everything else goes back to the parent
        answer = (ERROR, Failure.capture(e, keep_exception=True))
    else:
        try:
            answer = (OK, cloudpickle.dumps(value))
        except Exception:  # noqa: BLE001
            message = f"the return value of type {type(value).__name__} cannot be pickled"
            answer = (ERROR, Failure("TypeError", message, f"TypeError: {message}\n"))
    result_w.send_bytes(cloudpickle.dumps(answer))
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

    ctx = get_mp_context()
    result_r, result_w = ctx.Pipe(duplex=False)
    output_r, output_w = ctx.Pipe(duplex=False)
    label = name or getattr(fn, "__qualname__", "function")
    child = start_process(_run_and_send, cloudpickle.dumps((fn, args, kwargs)), result_w, output_w,
                          name=f"isolated:{label}", ctx=ctx)
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
        return _unpack(cloudpickle.loads(data), output.decode(errors="replace"))
    finally:
        result_r.close()
        child.close(grace_s=5.0)
        read_output(0)
        output_r.close()
        if output:
            sys.stderr.write(output.decode(errors="replace"))
            sys.stderr.flush()


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
