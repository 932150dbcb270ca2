"""Folding a dependent check into its root only for the root's own cause (``checks.causes``, ``runner.run_item``).

The cause comparison is tested directly on real exceptions, wrapped as the checks and the engine wrap them; one
planted model (tests/plugin_zoo/zoo/planted_fold.py: a TP=2 sharding bug in layer 1 AND a leaked helper process)
is read from the zoo.planted session (tests/zoo_sessions.py, shared with test_planted_bugs), where ``run_item`` ran
it: load[tp=1] fails for the leak (its engine is the first to shut down), load[tp=2] fails for the sharding and says
that load[tp=1] failed too, startup fails for the leak and is folded into load[tp=1].
"""

from __future__ import annotations

import traceback
from typing import Any

import pytest

from engine_ref.errors import WorkerStartupError
from engine_ref.isolation import ProcessCrashedError, RemoteTraceback
from pytest_enginecheck.checks import CheckContext, CheckFailure, CheckResult
from pytest_enginecheck.checks.causes import failure_cause, first_exception, same_cause
from tests.zoo_sessions import PLANTED as PLANTED_SESSION
from tests.zoo_sessions import zoo_session

# the fixture that reads a shared zoo session -> its name (started early: tests/zoo_sessions.py)
ZOO_SESSIONS = {"planted": "planted"}

SPEC = "zoo.planted:REGISTRY"
PLANTED = "ShardAndLeakLlamaForCausalLM"
TWIN = "CleanTwinLlamaForCausalLM"


def context(check: str = "startup", module: str = "zoo.cuda_llama", tp: int = 1, workdir: str = "") -> CheckContext:
    return CheckContext(check=check, spec=SPEC, architecture="Arch", module=module, class_name="Model",
                        workdir=workdir, tp=tp)


def build_error() -> BaseException:
    """What a model's constructor raises, caught as the check child catches it."""
    try:
        raise ValueError("rope_theta must be set for the broken-build zoo model\nsecond line")
    except ValueError as e:
        return e


def relayed(pid: int) -> CheckFailure:
    """The same constructor error raised on an mp worker: the engine's WorkerStartupError (with the worker's
    traceback as its cause), wrapped by the check's own words (``tiny_engine.start_engine``)."""
    try:
        raise build_error()
    except ValueError:
        text = traceback.format_exc()
    error = WorkerStartupError(f"Worker rank 0 (pid {pid}) failed in load_model: ValueError: rope_theta ...")
    error.__cause__ = RemoteTraceback(text)
    try:
        try:
            raise error
        except WorkerStartupError as e:
            raise CheckFailure(f"Arch failed to start at tensor_parallel_size=2: {e}", {"kind": "WorkerStartupError"}
                               ) from None
    except CheckFailure as failure:
        return failure


def cause(exc: BaseException | None = None, detail: dict[str, Any] | None = None, message: str = "",
          ctx: CheckContext | None = None) -> str:
    """The cause of a failure, its detail the CheckFailure's (as ``run_in_child`` passes them) unless given."""
    if detail is None:
        detail = exc.detail if isinstance(exc, CheckFailure) else {}
    return failure_cause(ctx or context(), message or str(exc), detail, exc)


def test_a_build_exception_is_one_cause_whatever_wraps_it() -> None:
    e = build_error()
    in_process = cause(e, {"kind": "error", "traceback": "".join(traceback.format_exception(e))})
    assert in_process == "ValueError: rope_theta must be set for the broken-build zoo model"
    assert cause(relayed(pid=101)) == cause(relayed(pid=202)) == in_process  # another worker, another pid
    wrapped = relayed(pid=101)
    assert cause(wrapped, ctx=context("budget", tp=2)) == in_process  # another check, its own words


def test_a_module_that_does_not_import_is_one_cause() -> None:
    frames = ('Traceback (most recent call last):\n  File "/tmp/x/zoo/cuda_llama.py", line 7, in <module>\n'
              '    WORKSPACE = torch.zeros(16, device="cuda")\nAssertionError: Torch not compiled with CUDA enabled\n')
    import_check = cause(detail={"kind": "cuda", "access": "init", "chain": ["zoo.cuda_llama"]},
                         message="Importing zoo.cuda_llama touched CUDA", ctx=context("import"))
    load = cause(detail={"kind": "error", "traceback": frames}, message="Loading Arch raised AssertionError")
    inspect = cause(message=f"Error inspecting model architecture 'Arch' in a subprocess:\n{frames}",
                    detail={"kind": "inspection"})
    assert import_check == load == inspect == "import zoo.cuda_llama"
    # the same file name in another package, or a frame of the module that is not its import, is something else
    assert cause(detail={"traceback": frames.replace("/x/zoo/", "/x/myzoo/")}) != "import zoo.cuda_llama"
    assert cause(detail={"traceback": frames.replace("<module>", "__init__")}) != "import zoo.cuda_llama"
    missing = "ImportError: module 'zoo.cuda_llama' has no class 'Model'; fix the registration\n"
    assert cause(detail={"kind": "missing_class"}, ctx=context("import")) == cause(message=missing) == \
           "import zoo.cuda_llama"


def test_a_process_fate_is_its_cause() -> None:
    crashed = ProcessCrashedError("inspect Arch was killed by SIGSEGV before returning a result.", -11)
    try:
        try:
            raise crashed
        except ProcessCrashedError as e:
            raise CheckFailure("Error inspecting model architecture 'Arch'", {"kind": "inspection"}) from e
    except CheckFailure as failure:
        inspect = cause(failure)
    assert inspect == cause(detail={"kind": "crash", "signal": "SIGSEGV"}) == "crash SIGSEGV"
    assert cause(detail={"kind": "exit", "exit_code": 3}) == cause(detail={"kind": "exit", "code": 3}) == "exit 3"
    assert cause(detail={"kind": "timeout", "stacks": 'File "/x/zoo/cuda_llama.py", line 3 in <module>'}) == "timeout"


def test_findings_of_other_kinds_are_other_causes() -> None:
    leak = cause(CheckFailure("Arch started and shut down, but left behind: process 7", {"kind": "leak"}))
    shard = cause(CheckFailure("At tensor_parallel_size=2, Arch generates different tokens", {"kind": "tp_mismatch"}))
    assert (leak, shard) == ("leak", "tp_mismatch")
    assert not same_cause({"cause": leak}, {"cause": shard})
    assert same_cause({"cause": shard}, {"cause": "tp_mismatch"})
    assert not same_cause({}, {})  # a result without a cause matches nothing


def test_the_first_exception_a_traceback_prints() -> None:
    try:
        try:
            raise KeyError("model.layers.1.mlp.down_proj.weight")
        except KeyError as e:
            raise ValueError("bad checkpoint") from e
    except ValueError:
        text = traceback.format_exc()
    assert first_exception(text) == "KeyError: 'model.layers.1.mlp.down_proj.weight'"
    assert first_exception("") is None


@pytest.fixture(scope="module")
def planted(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, str], CheckResult]:
    """The planted model's import, load[tp=1], load[tp=2] and startup, and the clean twin's startup, as ``run_item``
    returned them in the zoo.planted session (every root selected)."""
    session = zoo_session(tmp_path_factory, "planted", *PLANTED_SESSION)
    assert f"--enginecheck-target={SPEC}" in PLANTED_SESSION
    return {(arch, item): CheckResult(**session.results[arch, item])
            for arch, item in ((PLANTED, "import"), (PLANTED, "load[tp=1]"), (PLANTED, "load[tp=2]"),
                               (PLANTED, "startup"), (TWIN, "startup"))}


def test_an_independent_failure_stays_a_failure(planted: dict[tuple[str, str], CheckResult]) -> None:
    assert planted[PLANTED, "import"].outcome == "passed"
    leak = planted[PLANTED, "load[tp=1]"]
    assert (leak.outcome, leak.detail["kind"]) == ("failed", "leak"), leak.message
    assert leak.message.startswith(f"{PLANTED} started and shut down at tensor_parallel_size=1, but left behind")
    load = planted[PLANTED, "load[tp=2]"]
    assert (load.outcome, load.detail["kind"]) == ("failed", "tp_mismatch"), load.message
    assert "model.layers.1.mlp.down_proj" in load.message
    assert load.message.splitlines()[-1] == f"(load[tp=1] failed too, see enginecheck::{PLANTED}::load[tp=1].)"
    startup = planted[PLANTED, "startup"]  # the leak again: one root cause, one failure
    assert (startup.outcome, startup.detail["kind"]) == ("skipped", "dependency"), startup.message
    assert startup.message == f"load[tp=1] failed, see enginecheck::{PLANTED}::load[tp=1]"
    assert startup.detail["failure"].startswith(f"{PLANTED} started and shut down at tensor_parallel_size=2, but "
                                                f"left behind: child processes [")


def test_the_clean_twin_passes(planted: dict[tuple[str, str], CheckResult]) -> None:
    startup = planted[TWIN, "startup"]
    assert startup.outcome == "passed", startup.message
    assert "cause" not in startup.detail
