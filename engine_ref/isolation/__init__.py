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

The package, one module per concept: ``context`` (the start method and the stdlib hook),
``process`` (one child's lifecycle), ``wait`` (waiting on answers and sentinels until a deadline),
``answer`` (the ``(status, payload)`` shape every child answers in), ``call`` (run_isolated, and
the CallStats of its latest call: start and answer time, payload bytes) and ``errors``.
"""

from engine_ref.isolation.answer import ERROR, OK, Answer, Failure
from engine_ref.isolation.call import CallStats, last_call_stats, run_isolated
from engine_ref.isolation.context import add_preload_modules, ensure_warm_parent, get_mp_context
from engine_ref.isolation.errors import (
    IsolatedProcessError,
    ProcessCrashedError,
    ProcessTimeoutError,
    RemoteError,
    RemoteTraceback,
    describe_exitcode,
    describe_signal,
    tail,
)
from engine_ref.isolation.process import WarmProcess, start_process
from engine_ref.isolation.wait import AnswerWait, Deadline

__all__ = [
    "ERROR", "OK", "Answer", "AnswerWait", "CallStats", "Deadline", "Failure", "IsolatedProcessError",
    "ProcessCrashedError", "ProcessTimeoutError", "RemoteError", "RemoteTraceback", "WarmProcess",
    "add_preload_modules", "describe_exitcode", "describe_signal", "ensure_warm_parent", "get_mp_context",
    "last_call_stats", "run_isolated", "start_process", "tail",
]
