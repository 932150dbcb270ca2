"""A vLLM worker's failure told like engine_ref's: the phase, the rank, the root exception, and the
user's own frames first (frames outside vLLM, torch, the standard library and this plugin)."""

from __future__ import annotations

import os
import sysconfig
import traceback
from dataclasses import dataclass

# vLLM functions that begin a startup phase, innermost wins: the phase a traceback failed in.
PHASES = (
    ("create_engine_config", "config"), ("init_device", "init_device"), ("load_model", "load_model"),
    ("load_weights", "load_model"), ("determine_available_memory", "kv_cache"),
    ("initialize_kv_cache", "kv_cache"), ("compile_or_warm_up_model", "warmup"), ("generate", "generate"),
    ("shutdown", "shutdown"),
)
_LIBRARY_DIRS = tuple({sysconfig.get_paths()["stdlib"], sysconfig.get_paths()["purelib"],
                       sysconfig.get_paths()["platlib"]})


@dataclass(frozen=True)
class EngineFailure:
    """What went wrong on one rank."""

    phase: str
    rank: int
    exception: str  # "Type: message" of the root exception
    user_frames: str
    traceback: str

    def describe(self, architecture: str, tp: int, dtype: str = "") -> str:
        """What failed, where, at which TP size (and, given, in which dtype vLLM ran), and the user's frames."""
        frames = f"\nIn your code:\n{self.user_frames}" if self.user_frames else ""
        ran_in = f" ({dtype})" if dtype else ""
        return (f"{architecture} failed in phase {self.phase} on rank {self.rank} at tensor_parallel_size={tp}"
                f"{ran_in}: {self.exception}{frames}")


def _is_user(filename: str) -> bool:
    return os.path.isabs(filename) and not (filename.startswith(_LIBRARY_DIRS)
                or f"{os.sep}pytest_enginecheck{os.sep}" in filename)


def _root(exc: BaseException) -> BaseException:
    while exc.__cause__ is not None or (exc.__context__ is not None and not exc.__suppress_context__):
        exc = exc.__cause__ or exc.__context__  # type: ignore[assignment]
    return exc


def classify(exc: BaseException, rank: int) -> EngineFailure:
    """The EngineFailure for an exception raised on ``rank`` while vLLM started or ran."""
    root = _root(exc)
    frames = traceback.extract_tb(root.__traceback__) or traceback.extract_tb(exc.__traceback__)
    all_frames = [f for e in (exc, root) for f in traceback.extract_tb(e.__traceback__)]
    phase = "startup"
    for frame in all_frames:
        phase = next((p for name, p in PHASES if frame.name == name), phase)
    user = [f for f in frames if _is_user(f.filename)]
    return EngineFailure(phase=phase, rank=rank,
                         exception="".join(traceback.format_exception_only(root)).strip(),
                         user_frames="".join(traceback.format_list(user)).rstrip(),
                         traceback="".join(traceback.format_exception(exc)))
