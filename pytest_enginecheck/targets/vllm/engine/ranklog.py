"""What a warm vLLM rank printed, trimmed to what is about the check's outcome before it reaches the report.

Each rank writes its stdout and stderr (vLLM's log, Python warnings, a faulthandler dump) to its own file
(``capture_output``); after the ranks end, ``trimmed_log`` keeps what a model author needs: where a rank failed,
that rank's WARNING and ERROR records and everything that is not a vLLM log record (a raw traceback, a crash's
stacks); where all ranks answered, only ERROR records and non-record lines. vLLM's known noise (``NOISE``: a
tokenizer-less engine's chat-template warmup traceback, the CPU worker's thread-count notice) and what every target
drops (``pytest_enginecheck.output``: Python warnings, progress bars, NUMA notices) go either way, counted in one
line. ``ENGINECHECK_FULL_OUTPUT=1`` keeps every line (``ENGINECHECK_VLLM_LOG=full``, its older name, too). The
check's own message comes first in pytest's report; this text is what pytest shows under "Captured stderr".
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

from pytest_enginecheck.output import full_output, left_out, without_noise

# vLLM's log line: "(<process> pid=N) LEVEL MM-DD HH:MM:SS [file.py:line] text" (the prefix only in its subprocesses
# and named forks); a multi-line record repeats the same header on every line.
RECORD = re.compile(r"^(?P<header>(?:\([^)]*\) )?(?P<level>DEBUG|INFO|WARNING|ERROR|CRITICAL) "
                    r"\d\d-\d\d \d\d:\d\d:\d\d \[[^\]]+\]) (?P<text>.*)$")
# Records that are never about the model: (first line's text) patterns.
NOISE = (
    re.compile(r"^Chat template warmup failed"),  # skip_tokenizer_init: vLLM's renderer has no tokenizer to warm up
    re.compile(r"^CPU backend doesn't allow to use `torch.set_num_threads`"),
)
KEPT = {True: ("WARNING", "ERROR", "CRITICAL"), False: ("ERROR", "CRITICAL")}  # by: did this rank fail


def capture_output(path: str) -> None:
    """Send this process's stdout and stderr (file descriptors 1 and 2, so native code's output too) to ``path``."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)


@dataclass
class _Record:
    header: str | None  # None: a line that is not vLLM's log record
    level: str
    lines: list[str]


def _records(text: str) -> list[_Record]:
    records: list[_Record] = []
    for line in text.splitlines():
        match = RECORD.match(line)
        if match is None:
            records.append(_Record(None, "", [line]))
        elif records and records[-1].header == match["header"]:
            records[-1].lines.append(line)
        else:
            records.append(_Record(match["header"], match["level"], [line]))
    return records


def _noise(record: _Record) -> bool:
    match = RECORD.match(record.lines[0]) if record.header is not None else None
    return match is not None and any(p.search(match["text"]) for p in NOISE)


def trimmed_log(text: str, failed: bool, label: str = "") -> str:
    """``text`` (the output of ``label``, a rank) without vLLM's noise and, unless ``failed``, without its WARNING
    records; INFO and DEBUG records always go. Ends with one line saying how many lines were left out, if any."""
    if full_output():
        return text
    kept: list[str] = []
    dropped = 0
    for record in _records(text):
        if record.header is None and not record.lines[0].strip():
            continue
        if (record.header is None or record.level in KEPT[failed]) and not _noise(record):
            kept.extend(record.lines)
        else:
            dropped += len(record.lines)
    kept, noise = without_noise(kept)
    if dropped + noise:
        kept.append(left_out(dropped + noise, f"{label or 'a rank'}'s output (vLLM's log not about this outcome, "
                                              f"warnings, progress bars, known noise)"))
    return "\n".join(kept) + "\n" if kept else ""
