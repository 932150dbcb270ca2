"""The startup trace: a StartupReport as Chrome trace-event JSON, for ui.perfetto.dev or chrome://tracing.

One process (the engine's pid), one track per rank plus the engine's own: the EngineCore phases on
track 0, each rank's steps (init_device, load_model with a slice per file it read, profile_run,
initialize_cache) on track ``rank + 1``. Every slice is a complete event (``ph: "X"``) on the machine's
monotonic clock, so a rank's steps sit inside the engine phase that waited for them.
ENGINE_REF_TRACE_DIR makes every engine start write one (``write_startup_trace``).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from engine_ref.engine.report import Span, StartupReport

ENGINE_TRACK = 0


def _slice(span: Span, pid: int, tid: int, origin_ns: int) -> dict[str, Any]:
    return {"name": span.name, "cat": "startup", "ph": "X", "pid": pid, "tid": tid,
            "ts": (span.start_ns - origin_ns) / 1e3, "dur": (span.end_ns - span.start_ns) / 1e3, "args": span.args}


def _name(kind: str, pid: int, tid: int | None, name: str, sort: int) -> list[dict[str, Any]]:
    """The metadata events that name a process or thread track and fix its order."""
    ids = {"pid": pid} if tid is None else {"pid": pid, "tid": tid}
    return [{"name": f"{kind}_name", "ph": "M", **ids, "args": {"name": name}},
            {"name": f"{kind}_sort_index", "ph": "M", **ids, "args": {"sort_index": sort}}]


def startup_trace(report: StartupReport) -> dict[str, Any]:
    """The report's spans as a trace-event JSON object (times in microseconds from the first span)."""
    spans = [*report.spans, *(s for w in report.workers for s in w.spans)]
    origin = min((s.start_ns for s in spans), default=0)
    pid = report.pid or os.getpid()
    events = _name("process", pid, None, f"engine_ref {report.architecture} tp={report.tensor_parallel_size}", 0)
    events += _name("thread", pid, ENGINE_TRACK, f"EngineCore (pid {pid})", 0)
    events += [_slice(s, pid, ENGINE_TRACK, origin) for s in report.spans]
    for w in report.workers:
        events += _name("thread", pid, w.rank + 1, f"rank {w.rank} (pid {w.pid}, {w.device})", w.rank + 1)
        events += [_slice(s, pid, w.rank + 1, origin) for s in w.spans]
    return {"traceEvents": events, "displayTimeUnit": "ms",
            "otherData": {"architecture": report.architecture, "model": report.model,
                          "tensor_parallel_size": report.tensor_parallel_size,
                          "executor": report.executor_backend}}


def trace_file_name(report: StartupReport) -> str:
    """A file name for this start that no other start takes (for a directory of traces)."""
    return f"startup-{report.architecture}-tp{report.tensor_parallel_size}-{os.getpid()}-{time.monotonic_ns()}.json"


def write_startup_trace(report: StartupReport, path: str | os.PathLike[str]) -> Path:
    """Write the trace to the file ``path``, atomically (its directory is created)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(startup_trace(report)) + "\n")
    tmp.replace(path)
    return path
