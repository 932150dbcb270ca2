"""The one warm-process mechanism: every child engine_ref starts is a fork of a warm parent.

Importing torch costs seconds; forking a process that already imported it costs milliseconds. So the
registry's inspection, the multiprocess executor's workers and pytest_enginecheck's isolated checks
all start through ``start_process``, which by default uses multiprocessing's *forkserver*: a server
process, started once per parent by exec (so it never inherits CUDA state), preloads torch and
engine_ref's core (``engine_ref.warmup``, which imports no model module and never touches CUDA) and
forks a child for each request.

A child that starts children of its own (the registry's inspection inside a check, the workers of
an engine a check starts) forks them directly: it is itself warm, single-threaded and CUDA-free,
whereas asking for a forkserver there would start a new one (seconds).

Every child gets, on top of what multiprocessing gives:
- the parent's current environment (forkserver children would otherwise see the server's);
- its own process group, or its caller's when the caller is itself an isolated child, so that
  ``kill_tree`` ends a child together with everything it started;
- a death pipe armed with O_ASYNC: when the parent dies, the kernel sends SIGIO (whose default
  action terminates) to the child's process group, with no thread and no Python code involved;
- faulthandler on SIGUSR1, so a hung child's Python stacks can be read back before it is killed.
"""

from __future__ import annotations

import fcntl
import faulthandler
import gc
import logging
import multiprocessing
import multiprocessing.connection
import multiprocessing.spawn
import os
import signal
import sys
import threading
import time
import traceback
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.context import BaseContext
from typing import Any

from engine_ref import envs
from engine_ref.errors import ConfigError, EngineRefError

logger = logging.getLogger(__name__)

PRELOAD_MODULES = ["engine_ref.warmup"]  # extend with add_preload_modules()
START_METHODS = ("forkserver", "spawn", "fork")

# True in a child started by start_process: its own children fork from it and join its group.
_in_isolated_group = False
_death_pipe: Connection | None = None  # kept open for the life of the child
# Set while this thread starts one of our children: see _preparation_data.
_launching = threading.local()
_original_get_preparation_data = multiprocessing.spawn.get_preparation_data


class IsolatedProcessError(EngineRefError):
    """An isolated child did not return: it crashed, exited early or timed out.

    ``output`` is what the child wrote to stdout and stderr.
    """

    output: str = ""


class ProcessCrashedError(IsolatedProcessError):
    """The child died by a signal or exited without sending a result."""

    def __init__(self, message: str, exitcode: int | None) -> None:
        super().__init__(message)
        self.exitcode = exitcode

    @property
    def signal_name(self) -> str | None:
        if self.exitcode is not None and self.exitcode < 0:
            return describe_signal(-self.exitcode)
        return None


class ProcessTimeoutError(IsolatedProcessError):
    """The child ran past its timeout; ``stacks`` holds its Python stacks at that moment."""

    def __init__(self, message: str, stacks: str) -> None:
        super().__init__(message)
        self.stacks = stacks


class RemoteError(IsolatedProcessError):
    """The child raised an exception that could not be sent back as itself."""

    def __init__(self, type_name: str, message: str, remote_traceback: str) -> None:
        super().__init__(f"{type_name}: {message}\n\nRemote traceback:\n{remote_traceback}")
        self.type_name = type_name
        self.remote_traceback = remote_traceback


class RemoteTraceback(Exception):
    """Attached as ``__cause__`` of an exception re-raised from a child: the child's traceback."""

    def __init__(self, text: str) -> None:
        super().__init__(text)
        self.text = text

    def __str__(self) -> str:
        return self.text


def describe_signal(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def describe_exitcode(exitcode: int | None) -> str:
    """-9 -> 'was killed by SIGKILL'; 3 -> 'exited with code 3'."""
    if exitcode is None:
        return "is still running"
    if exitcode < 0:
        return f"was killed by {describe_signal(-exitcode)}"
    return f"exited with code {exitcode}"


def _cuda_initialized() -> bool:
    torch = sys.modules.get("torch")
    return bool(torch is not None and torch.cuda.is_initialized())


def _preparation_data(name: str) -> dict[str, Any]:
    """multiprocessing's preparation data, minus the parent's ``__main__`` for our own children.

    multiprocessing re-imports the parent's main module in every forkserver or spawn child, so
    that targets defined there unpickle. Ours travel by cloudpickle and never need it, and under
    the ``pytest`` console script that import alone costs a child ~150 ms (it imports pytest).
    Other callers of multiprocessing are unaffected: the flag is per thread and set only by us.
    """
    data = _original_get_preparation_data(name)
    if getattr(_launching, "active", False):
        data.pop("init_main_from_path", None)
        data.pop("init_main_from_name", None)
    return data


def get_mp_context() -> BaseContext:
    """The multiprocessing context children start from (ENGINE_REF_WORKER_MULTIPROC_METHOD).

    forkserver (default): forks of a warm server that preloaded torch. fork: forks of this process,
    refused with a warning (spawn instead) once this process has initialized CUDA. spawn: a fresh
    interpreter per child (slow; for platforms without fork).
    """
    method = envs.worker_multiproc_method()
    if _in_isolated_group and method == "forkserver":
        method = "fork"  # this process is warm itself (see the module docstring)
    if method not in START_METHODS:
        raise ConfigError(
            f"ENGINE_REF_WORKER_MULTIPROC_METHOD={method!r} is unknown; use one of {', '.join(START_METHODS)}."
        )
    if method == "fork" and _cuda_initialized():
        warnings.warn(
            "This process has initialized CUDA, and a forked child cannot use CUDA "
            "('Cannot re-initialize CUDA in forked subprocess'); starting workers with 'spawn' instead. "
            "Use the default 'forkserver' method, or avoid touching CUDA before the engine starts.",
            RuntimeWarning,
            stacklevel=3,
        )
        method = "spawn"
    if method in multiprocessing.get_all_start_methods():
        ctx = multiprocessing.get_context(method)
    else:
        ctx = multiprocessing.get_context("spawn")
    if ctx.get_start_method() == "forkserver":
        ctx.set_forkserver_preload(PRELOAD_MODULES)
    multiprocessing.spawn.get_preparation_data = _preparation_data
    return ctx


@dataclass
class _ChildSetup:
    env: dict[str, str]
    pgid: int  # 0: lead a new group
    death_r: Connection
    stack_w: Connection
    death_w: Connection | None = None  # set under "fork" only: the inherited copy to close in the child


def _arm_death_pipe(death_r: Connection) -> None:
    """Have the kernel SIGIO this process group (or this process) once the parent's end closes."""
    global _death_pipe
    _death_pipe = death_r
    fd = death_r.fileno()
    leads_group = os.getpgrp() == os.getpid()
    fcntl.fcntl(fd, fcntl.F_SETOWN, -os.getpgrp() if leads_group else os.getpid())
    signal.signal(signal.SIGIO, signal.SIG_DFL)
    fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) | os.O_ASYNC)
    if death_r.poll():  # the parent died before the pipe was armed
        os.kill(0 if leads_group else os.getpid(), signal.SIGIO)


def _child_main(setup: _ChildSetup, target: Callable[..., Any], args: tuple) -> None:
    global _in_isolated_group
    # Everything inherited from the warm parent is long-lived: keep the collector from walking it,
    # which would write to every object's header and copy most of the parent's pages (~10 ms).
    gc.freeze()
    os.environ.clear()
    os.environ.update(setup.env)
    try:
        os.setpgid(0, setup.pgid)
    except OSError:  # the caller's group is gone or in another session: lead our own
        os.setpgid(0, 0)
    _in_isolated_group = True
    if _cuda_initialized():
        raise RuntimeError(
            f"the warm parent of this {multiprocessing.get_start_method()} child has initialized CUDA, so the "
            f"child cannot use it; a preloaded module ({', '.join(PRELOAD_MODULES)}) touched CUDA at import.")
    if setup.death_w is not None:
        setup.death_w.close()
    faulthandler.enable(all_threads=True)  # a segfault leaves the Python stacks on stderr
    faulthandler.register(signal.SIGUSR1, file=setup.stack_w.fileno(), all_threads=True)
    _arm_death_pipe(setup.death_r)
    target(*args)


class WarmProcess:
    """A child started by ``start_process``: its Process, plus stack dumps and whole-tree kill."""

    def __init__(self, process: multiprocessing.process.BaseProcess, death_w: Connection, stack_r: Connection,
                 leads_group: bool) -> None:
        self.process = process
        self._death_w = death_w
        self._stack_r = stack_r
        self._leads_group = leads_group

    @property
    def pid(self) -> int:
        assert self.process.pid is not None
        return self.process.pid

    @property
    def sentinel(self) -> int:
        return self.process.sentinel

    @property
    def exitcode(self) -> int | None:
        return self.process.exitcode

    def is_alive(self) -> bool:
        return self.process.is_alive()

    def dump_stacks(self, wait_s: float = 1.0) -> str:
        """The child's Python stacks (all threads), via faulthandler; empty if it is already gone."""
        try:
            os.kill(self.pid, signal.SIGUSR1)
        except ProcessLookupError:
            return ""
        chunks: list[bytes] = []
        deadline = time.monotonic() + wait_s
        fd = self._stack_r.fileno()
        while time.monotonic() < deadline:
            if not multiprocessing.connection.wait([self._stack_r], timeout=0.2 if chunks else 0.05):
                if chunks:
                    break
                continue
            data = os.read(fd, 65536)
            if not data:
                break
            chunks.append(data)
        return b"".join(chunks).decode(errors="replace")

    def kill_tree(self) -> None:
        """SIGKILL the child and, when it leads its own process group, everything it started."""
        if self.process.pid is None:
            return
        try:
            if self._leads_group:
                os.killpg(self.pid, signal.SIGKILL)
            else:
                os.kill(self.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass

    def terminate(self) -> None:
        if self.process.is_alive():
            self.process.terminate()

    def join(self, timeout: float | None = None) -> None:
        self.process.join(timeout)

    def close(self, grace_s: float = 0.0) -> None:
        """Reap the child (after ``grace_s`` to exit, then by SIGKILL to its group) and close its pipes."""
        if self.process.pid is not None:
            if grace_s:
                self.process.join(grace_s)
            if self.process.is_alive():
                self.kill_tree()
            self.process.join()
            if self._leads_group:
                try:  # stragglers the child started and left in its group
                    os.killpg(self.pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
        for conn in (self._death_w, self._stack_r):
            conn.close()
        self.process.close()


def start_process(target: Callable[..., Any], *args: Any, name: str = "engine_ref-child",
                  ctx: BaseContext | None = None) -> WarmProcess:
    """Start ``target(*args)`` in a warm child (see the module docstring); arguments must pickle.

    Connections among ``args`` are passed to the child; the caller should close its own copies of
    the ends it gave away.
    """
    ctx = ctx or get_mp_context()
    death_r, death_w = ctx.Pipe(duplex=False)
    stack_r, stack_w = ctx.Pipe(duplex=False)
    pgid = os.getpgrp() if _in_isolated_group else 0
    setup = _ChildSetup(env=dict(os.environ), pgid=pgid, death_r=death_r, stack_w=stack_w,
                        death_w=death_w if ctx.get_start_method() == "fork" else None)
    process = ctx.Process(target=_child_main, args=(setup, target, args), name=name, daemon=False)
    _launching.active = True
    try:
        process.start()
    except OSError as e:
        if "AF_UNIX path too long" not in str(e):
            raise
        import tempfile

        raise ConfigError(
            f"the warm parent's Unix socket cannot be created under TMPDIR={tempfile.gettempdir()!r}: the path "
            f"is longer than a Unix socket allows (108 bytes). Set TMPDIR to a shorter directory, e.g. /tmp."
        ) from None
    finally:
        _launching.active = False
    death_r.close()
    stack_w.close()
    return WarmProcess(process, death_w, stack_r, leads_group=pgid == 0)


def _run_and_send(payload: bytes, result_w: Connection, output_w: Connection) -> None:
    import cloudpickle

    os.dup2(output_w.fileno(), 1)
    os.dup2(output_w.fileno(), 2)
    output_w.close()
    try:
        fn, args, kwargs = cloudpickle.loads(payload)
        value = fn(*args, **kwargs)
    except SystemExit as e:  # the child asked to exit: the parent sees an exit code, as for any process
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(e.code if isinstance(e.code, int) else 1)
    except BaseException as e:  # noqa: BLE001 - everything else goes back to the parent
        try:
            exc_bytes = cloudpickle.dumps(e)
        except Exception:  # noqa: BLE001 - the exception does not pickle: its text still travels
            exc_bytes = None
        outcome: tuple = ("error", exc_bytes, type(e).__qualname__, str(e), traceback.format_exc())
    else:
        try:
            outcome = ("ok", cloudpickle.dumps(value))
        except Exception:  # noqa: BLE001
            message = f"the return value of type {type(value).__name__} cannot be pickled"
            outcome = ("error", None, "TypeError", message, f"TypeError: {message}\n")
    result_w.send_bytes(cloudpickle.dumps(outcome))
    result_w.close()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def tail(text: str, lines: int = 30) -> str:
    """The last ``lines`` lines of ``text``."""
    kept = text.rstrip().splitlines()[-lines:]
    return "\n".join(kept)


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

    def drain(block_s: float) -> None:
        while multiprocessing.connection.wait([output_r], timeout=block_s):
            chunk = os.read(output_r.fileno(), 65536)
            if not chunk:
                return
            output.extend(chunk)
            block_s = 0

    try:
        deadline = None if timeout is None else time.monotonic() + timeout
        data: bytes | None = None
        while True:
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            ready = multiprocessing.connection.wait([result_r, output_r, child.sentinel], timeout=remaining)
            if output_r in ready:
                drain(0)
            if result_r in ready or result_r.poll():
                try:
                    data = result_r.recv_bytes()
                except EOFError:
                    data = None
                break
            if child.sentinel in ready:  # the child ended without a result
                break
            if deadline is not None and time.monotonic() >= deadline:
                stacks = child.dump_stacks()
                child.kill_tree()
                drain(0.1)
                error: IsolatedProcessError = ProcessTimeoutError(
                    f"{label} did not finish within {timeout:g} s and was killed. "
                    f"Its Python stacks at that moment:\n{stacks or '(none could be read)'}",
                    stacks,
                )
                error.output = output.decode(errors="replace")
                raise error
        if data is None:
            child.join(5)
            drain(0.1)
            text = output.decode(errors="replace")
            error = ProcessCrashedError(
                f"{label} {describe_exitcode(child.exitcode)} before returning a result."
                + (f" Its last output:\n{tail(text)}" if text.strip() else ""), child.exitcode)
            error.output = text
            raise error
        return _unpack_result(cloudpickle.loads(data))
    finally:
        result_r.close()
        child.close(grace_s=5.0)
        drain(0)
        output_r.close()
        if output:
            sys.stderr.write(output.decode(errors="replace"))
            sys.stderr.flush()


def _unpack_result(outcome: tuple) -> Any:
    import cloudpickle

    if outcome[0] == "ok":
        return cloudpickle.loads(outcome[1])
    _, exc_bytes, type_name, message, tb_text = outcome
    try:
        exc = cloudpickle.loads(exc_bytes) if exc_bytes is not None else None
    except Exception:  # noqa: BLE001 - e.g. an __init__ that takes other arguments than it passes up
        exc = None
    if not isinstance(exc, BaseException):
        raise RemoteError(type_name, message, tb_text)
    exc.__cause__ = RemoteTraceback(tb_text)
    raise exc


def add_preload_modules(*names: str) -> None:
    """Also import these modules in the warm parent (they must import no model and touch no CUDA).

    Takes effect when the warm parent starts, so call it before the first child.
    """
    PRELOAD_MODULES.extend(n for n in names if n not in PRELOAD_MODULES)


def ensure_warm_parent() -> None:
    """Start the warm parent now (it otherwise starts on the first child), e.g. before a leak snapshot."""
    ctx = get_mp_context()
    if ctx.get_start_method() == "forkserver":
        from multiprocessing import forkserver

        forkserver.ensure_running()
