"""What a check's engine printed, and a failure's traceback, trimmed to what concerns the failure, for every target.

A failed item's report shows the check's message, the failure's traceback (``CheckResult.longrepr``) and what the
check's process printed (pytest's "Captured stdout/stderr" sections, ``items.CheckItem.add_report_section``). Both go
through the rules here:

- ``trimmed_output``: Python warnings (``file.py:12: FutureWarning: ...`` and the source line after it), progress
  bars (tqdm's ``Loading checkpoint shards: 100%|...| 2/2 [...]``, vLLM's ``... 100% Completed | 1/1 [...]``) and
  known noise (``NOISE``: NUMA binding notices, an environment variable overwritten) are dropped, with one line
  saying how many lines went;
- ``trimmed_traceback``: a traceback that reaches the author's code (``Authorship``: the registered model's module,
  and code that is neither the engine's, the standard library's, an installed library's nor this plugin's) shows
  its frames up to the author's last one, then the exception; the frames below it, this plugin's own frames above
  the engine's, and a chained exception's frames that never reach the author are each replaced by one line saying
  how many. A traceback that never reaches the author's code is left whole.

A passing item shows none of it. ``ENGINECHECK_FULL_OUTPUT=1`` shows everything, on every target;
``ENGINECHECK_VLLM_LOG=full``, the vLLM target's older name for it, still works.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import re
import sysconfig
from collections.abc import Callable, Iterable
from dataclasses import dataclass

FULL_OUTPUT_ENV = "ENGINECHECK_FULL_OUTPUT"
LEGACY_FULL_OUTPUT = ("ENGINECHECK_VLLM_LOG", "full")  # the vLLM target's older name and value, an alias
SHOWS_ALL = f"{FULL_OUTPUT_ENV}=1 shows them"

# A line's process prefix, as vLLM writes it in its subprocesses and named forks: "(vllm-rank-0 pid=7) ".
_PREFIX = re.compile(r"^\([^)]*pid=\d+\) ")
# warnings.showwarning's first line: "path/file.py:12: FutureWarning: message" (the source line, indented, follows).
_WARNING = re.compile(r"^\S.*:\d+: [A-Z]\w*Warning: ")
# tqdm's bar ("desc: 100%|#####| 2/2 [00:00<00:00, 9.1it/s]", "desc: 3it [00:00, 9.1it/s]") and vLLM's bar_format
# ("desc: 100% Completed | 1/1 [00:00<00:00, 9.1it/s]").
_PROGRESS = re.compile(r"\d{1,3}%\|[^|]*\| *\S+/\S+ \[|\d{1,3}% Completed \| *\S+/\S+ \[|\d+it \[\d+:\d\d")
# Lines that are never about a model's failure, wherever a target's engine prints them.
NOISE = (
    re.compile(r"NUMA binding: Using \w+ policy"),  # vLLM's CPU backend binding its memory to NUMA nodes
    re.compile(r"\bnuma_\w+ (?:or \w+ )?failed\. errno: "),  # ... which a container may not allow
    re.compile(r"Node -?\d+ is not in available memory nodes"),
    re.compile(r"CPU group key .* is not a valid memory node"),
    re.compile(r"Overwriting environment variable \w+ from "),  # vLLM setting its own variables
)

_HEADER = "Traceback (most recent call last):"
_FRAME = re.compile(r'^  File "(?P<file>[^"]+)", line \d+, in ')
_SITE = re.compile(r"[/\\](?:site|dist)-packages[/\\]([^/\\]+)")
_STDLIB = tuple({os.path.normpath(sysconfig.get_paths()[k]) + os.sep for k in ("stdlib", "platstdlib")})


def full_output() -> bool:
    """Whether the user asked for everything: ``ENGINECHECK_FULL_OUTPUT`` set (not empty, 0, false or no), or
    ``ENGINECHECK_VLLM_LOG=full``."""
    value = os.environ.get(FULL_OUTPUT_ENV, "").strip().lower()
    variable, full = LEGACY_FULL_OUTPUT
    return value not in ("", "0", "false", "no") or os.environ.get(variable) == full


def left_out(count: int, what: str) -> str:
    """The line that replaces ``count`` lines of ``what``."""
    return f"(enginecheck: {count} lines of {what} left out; {SHOWS_ALL})"


def is_noise(line: str) -> bool:
    """A progress bar or a line of ``NOISE`` (a Python warning spans two lines: see ``without_noise``)."""
    return bool(_PROGRESS.search(line)) or any(p.search(line) for p in NOISE)


def without_noise(lines: Iterable[str]) -> tuple[list[str], int]:
    """``lines`` without Python warnings (each with the source line printed after it), progress bars and ``NOISE``;
    and how many lines went."""
    kept: list[str] = []
    dropped = 0
    after_warning = False
    for line in lines:
        text = _PREFIX.sub("", line, count=1)
        if after_warning and text.startswith("  ") and not _FRAME.match(text):  # the warning's source line
            dropped, after_warning = dropped + 1, False
            continue
        after_warning = bool(_WARNING.match(text))
        if after_warning or is_noise(text):
            dropped += 1
            continue
        kept.append(line)
    return kept, dropped


def trimmed_output(text: str, is_author: Callable[[str], bool] | None = None) -> str:
    """What a check's process printed, without warnings, progress bars and known noise (one line says how many lines
    went), its tracebacks trimmed (``trimmed_traceback``, given ``is_author``); ``text`` itself when the user asked
    for everything."""
    if full_output() or not text:
        return text
    kept, dropped = without_noise(text.splitlines())
    lines: list[str] = []
    for line in kept:  # what was between two dropped blocks: one blank line at most, none at the ends
        if line.strip() or (lines and lines[-1].strip()):
            lines.append(line)
    while lines and not lines[-1].strip():
        lines.pop()
    body = "\n".join(lines)
    if is_author is not None:
        body = trimmed_traceback(body, is_author)
    if dropped:
        body += ("\n" if body else "") + left_out(dropped, "Python warnings, progress bars and known noise")
    return body + "\n" if body else ""


@dataclass(frozen=True)
class _Frame:
    start: int  # its first line in the text
    end: int  # the line after its last (source and caret lines)
    file: str


def _tracebacks(lines: list[str]) -> list[list[_Frame]]:
    """The frames of each traceback in ``lines`` (a chained exception's tracebacks are several), in order."""
    found: list[list[_Frame]] = []
    i = 0
    while i < len(lines):
        if lines[i].rstrip() != _HEADER:
            i += 1
            continue
        frames: list[_Frame] = []
        i += 1
        while i < len(lines) and (match := _FRAME.match(lines[i])):
            end = i + 1
            while end < len(lines) and (lines[end].startswith("    ") or lines[end].startswith("  [Previous line")):
                end += 1
            frames.append(_Frame(i, end, match["file"]))
            i = end
        found.append(frames)
    return found


def _frames_line(count: int, whose: str) -> str:
    return f"  ({count} {whose} frame{'s' if count > 1 else ''} not shown; {SHOWS_ALL})"


def trimmed_traceback(text: str, is_author: Callable[[str], bool],
                      is_harness: Callable[[str], bool] | None = None) -> str:
    """``text`` with each traceback in it that reaches the author's code (``is_author(filename)``) cut after the
    author's last frame; the frames of this plugin (``is_harness``, default ``is_harness_file``) before the first
    other frame, and every frame of a chained traceback that never reaches the author's code, hidden too. Each run
    of hidden frames becomes one line saying how many. ``text`` itself where no frame is the author's."""
    harness = is_harness or is_harness_file
    lines = text.splitlines()
    tracebacks = _tracebacks(lines)
    if full_output() or not any(is_author(f.file) for frames in tracebacks for f in frames):
        return text
    hidden: dict[int, tuple[int, str]] = {}  # first line of a hidden run -> (the line after it, its line)
    for frames in tracebacks:
        authors = [k for k, f in enumerate(frames) if is_author(f.file)]
        if not authors:
            runs = [(0, len(frames), "library")]
        else:
            lead = 0
            while lead < authors[0] and harness(frames[lead].file):
                lead += 1
            runs = [(0, lead, "pytest-enginecheck"), (authors[-1] + 1, len(frames), "library")]
        for first, last, whose in runs:
            if last > first:
                hidden[frames[first].start] = (frames[last - 1].end, _frames_line(last - first, whose))
    out: list[str] = []
    i = 0
    while i < len(lines):
        if i in hidden:
            i, line = hidden[i]
            out.append(line)
        else:
            out.append(lines[i])
            i += 1
    return "\n".join(out) + ("\n" if text.endswith("\n") else "")


@functools.cache
def _package_dir(name: str) -> str | None:
    """The directory of the top-level package ``name`` (found without importing it), with a trailing separator."""
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return None
    if spec is None or spec.origin is None:
        return None
    return os.path.dirname(os.path.normpath(spec.origin)) + os.sep


@functools.cache
def _harness_dirs() -> tuple[str, ...]:
    """This plugin's directory and the process mechanism that runs every check (``engine_ref.isolation``)."""
    import engine_ref.isolation

    return tuple(os.path.dirname(os.path.normpath(path)) + os.sep for path in (__file__, engine_ref.isolation.__file__))


def is_harness_file(filename: str) -> bool:
    """A frame of this plugin (its checks, its engine drivers) or of the process mechanism that runs them."""
    return os.path.normpath(filename).startswith(_harness_dirs())


@dataclass(frozen=True)
class Authorship:
    """Which frames of a traceback are the author's, for the architecture registered as ``module``.

    The author's: the module's own file (or package), even inside the engine (a bundled model); else not the
    engine's own packages (``library_packages``, a target's ``library_packages()``), not this plugin, not an
    installed library (``site-packages``: except the module's own top-level package installed there), not the
    standard library, and a real file: the author's other code, on the path or installed editable.
    """

    module: str
    library_packages: tuple[str, ...] = ()

    def __call__(self, filename: str) -> bool:
        if not os.path.isabs(filename):  # "<frozen importlib._bootstrap>", "<string>"
            return False
        path = os.path.normpath(filename)
        parts = self.module.split(".")
        own = os.sep + os.path.join(*parts)
        if path.endswith(own + ".py") or own + os.sep in path:
            return True
        library = tuple(d for d in map(_package_dir, self.library_packages) if d)
        if path.startswith((*library, *_harness_dirs())):
            return False
        installed = _SITE.search(path)
        if installed:  # an installed distribution: the author's only if it is the module's own package
            return installed[1] == parts[0] and parts[0] not in self.library_packages
        return not path.startswith(_STDLIB)
