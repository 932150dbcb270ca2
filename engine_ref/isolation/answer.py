"""The one shape of a child's answer: ``(OK, value)`` or ``(ERROR, Failure)``.

run_isolated's child, each WorkerProc (its startup and every call), each Ray actor and each rank of
pytest_enginecheck's ``run_multirank`` answer this way, so every parent reads them alike.
"""

from __future__ import annotations

import traceback
from contextlib import suppress
from dataclasses import dataclass
from typing import Any

from engine_ref.isolation.errors import RemoteTraceback

OK, ERROR = "ok", "error"
Answer = tuple[str, Any]  # (OK, value) or (ERROR, Failure)


@dataclass(frozen=True)
class Failure:
    """An exception raised in a child, as text, and as itself when it was asked for and pickles."""

    type_name: str
    message: str
    traceback: str
    phase: str = ""  # the step the child was in, for children that report steps (a worker's startup)
    exception: bytes | None = None  # cloudpickled, for run_isolated to re-raise it as itself

    @classmethod
    def capture(cls, error: BaseException, phase: str = "", keep_exception: bool = False) -> Failure:
        """``error``, the exception being handled (call it in its ``except`` block)."""
        exception = None
        if keep_exception:
            import cloudpickle

            with suppress(Exception):  # an exception that does not pickle: its text still travels
                exception = cloudpickle.dumps(error)
        return cls(type(error).__qualname__, str(error), traceback.format_exc(), phase, exception)

    @property
    def last_line(self) -> str:
        """The traceback's last line: 'ValueError: bad shape'."""
        lines = self.traceback.strip().splitlines()
        return lines[-1] if lines else f"{self.type_name}: {self.message}"

    def remote_traceback(self) -> RemoteTraceback:
        """The child's traceback, to attach as ``__cause__`` of what the parent raises."""
        return RemoteTraceback(self.traceback)
