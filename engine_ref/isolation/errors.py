"""What the parent raises when a child does not return, and how it names the way a process ended."""

from __future__ import annotations

import signal

from engine_ref.errors import EngineRefError


class IsolatedProcessError(EngineRefError):
    """An isolated child did not return: it crashed, exited early or timed out.

    ``output`` is what the child wrote to stdout and stderr.
    """

    def __init__(self, message: str, output: str = "") -> None:
        super().__init__(message)
        self.output = output


class ProcessCrashedError(IsolatedProcessError):
    """The child died by a signal or exited without sending a result."""

    def __init__(self, message: str, exitcode: int | None, output: str = "") -> None:
        super().__init__(message, output)
        self.exitcode = exitcode

    @property
    def signal_name(self) -> str | None:
        """'SIGKILL' when a signal ended the child, else None."""
        if self.exitcode is not None and self.exitcode < 0:
            return describe_signal(-self.exitcode)
        return None


class ProcessTimeoutError(IsolatedProcessError):
    """The child ran past its timeout; ``stacks`` holds its Python stacks at that moment."""

    def __init__(self, message: str, stacks: str, output: str = "") -> None:
        super().__init__(message, output)
        self.stacks = stacks


class RemoteError(IsolatedProcessError):
    """The child raised an exception that could not be sent back as itself."""

    def __init__(self, type_name: str, message: str, remote_traceback: str, output: str = "") -> None:
        super().__init__(f"{type_name}: {message}\n\nRemote traceback:\n{remote_traceback}", output)
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
    """15 -> 'SIGTERM'; a number without a name -> 'signal 99'."""
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


def tail(text: str, lines: int = 30) -> str:
    """The last ``lines`` lines of ``text``."""
    kept = text.rstrip().splitlines()[-lines:]
    return "\n".join(kept)
