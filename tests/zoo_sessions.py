"""``pytest --enginecheck`` sessions over the zoo (tests/plugin_zoo) shared by the tests that only read their
results: each distinct configuration runs once per test session, whichever pytest-xdist worker asks first (under a
file lock in the temp dir the workers' base temp dirs share), and every test gets its exit status, output and JSON
report. A test that needs a session of its own (an option's effect, a usage error, xdist against serial) starts
its own; these are the runs several test modules would otherwise repeat.

A test module that reads a session names it in ``ZOO_SESSIONS`` (its fixture that reads it -> the session's name);
once collection ends, the first worker starts each session a selected test needs in the background
(``start_needed``), so it runs beside the other tests instead of holding a worker while the other waits for it."""

from __future__ import annotations

import contextlib
import fcntl
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

ZOO = Path(__file__).parent / "plugin_zoo"

# The zoo's root causes (a module touching CUDA at import, a model that cannot be built) under every check that
# depends on them: test_checks reads its verdicts and folding, test_sharding its verdicts against the 3 shards (so
# it stores pytest-split's durations, where pytest-split is installed), test_html_report renders its report.
ROOT_CAUSES = ("--enginecheck-target=zoo.root_causes:REGISTRY",
               "--enginecheck-checks=import,inspect,load,budget,startup", "-rfEs",
               *(("--store-durations", "--durations-path={dir}/durations.json")
                 if importlib.util.find_spec("pytest_split") else ()))
# Every planted bug of zoo.planted (test_planted_bugs, test_determinism, test_folding).
PLANTED = ("--enginecheck-target=zoo.planted:REGISTRY",
           "--enginecheck-checks=import,inspect,load,budget,startup,quant", "--enginecheck-quant=int8")

# The quantization bugs of zoo.quant_bugs beside its clean twin, every method at TP 1 and 2 (test_quant_check).
QUANT = ("--enginecheck-target=zoo.quant_bugs:REGISTRY", "--enginecheck-checks=quant",
         "--enginecheck-quant=int8,fp8", "--enginecheck-tp=1,2")


# The load check's TP diagnosis of the three TP bugs of zoo.tp_registry, and startup beside it (test_diagnosis).
TP_DIAGNOSIS = ("--enginecheck-target=zoo.tp_registry:REGISTRY", "--enginecheck-checks=load,startup")

# The lora check over the bundled zoo (the default target, no plugin loaded), and over zoo.lora_models: a layer
# that tells LoRA the wrong input columns at TP=2 while its own weights load right (test_lora_check).
LORA_BUNDLED = ("--enginecheck-checks=lora", "-v")
LORA_SHARD = ("--enginecheck-target=zoo.lora_models:REGISTRY", "--enginecheck-checks=load,lora")

# load[tp=1]'s reference oracle over zoo.reference_registry: its planted bugs and clean twins (test_reference_oracle).
REFERENCE = ("--enginecheck-target=zoo.reference_registry:REGISTRY", "--enginecheck-checks=import,inspect,load",
             "--enginecheck-tp=1")

# --enginecheck-strict in every rank over zoo.strict_registry, its planted CUDA accesses and clean twin; and without
# it, where the queries pass (test_strict_ranks).
STRICT_RANKS = ("--enginecheck-target=zoo.strict_registry:REGISTRY", "--enginecheck-strict", "--enginecheck-tp=1,2",
                "--enginecheck-checks=load,budget,startup")
LENIENT_RANKS = ("--enginecheck-target=zoo.strict_registry:REGISTRY", "--enginecheck-tp=1,2",
                 "--enginecheck-checks=load,startup", "-k", "not Clean")

# budget[tp=N]'s workload over zoo.budget_registry: its planted bugs and clean twins (test_budget_workload).
BUDGET_WORKLOAD = ("--enginecheck-target=zoo.budget_registry:REGISTRY", "--enginecheck-checks=budget",
                   "--enginecheck-tp=1,2")

# load over zoo.proofs_registry, and budget of its models that ask torch.distributed for their rank: diagnoses that
# say only what they proved, their planted bugs and clean twins (test_diagnosis_proofs).
DIAGNOSIS_PROOFS = ("--enginecheck-target=zoo.proofs_registry:REGISTRY", "--enginecheck-checks=load,budget",
                    "--enginecheck-tp=1,2", "-k", "load or Rank")

# The sessions a module can name in its ZOO_SESSIONS: name -> arguments.
SESSIONS: dict[str, tuple[str, ...]] = {"root-causes": ROOT_CAUSES, "planted": PLANTED, "quant": QUANT,
                                        "tp-diagnosis": TP_DIAGNOSIS, "lora-bundled": LORA_BUNDLED,
                                        "lora-shard": LORA_SHARD, "reference": REFERENCE,
                                        "strict-ranks": STRICT_RANKS, "lenient-ranks": LENIENT_RANKS,
                                        "budget-workload": BUDGET_WORKLOAD,
                                        "diagnosis-proofs": DIAGNOSIS_PROOFS}
TIMEOUT = 900  # seconds a session may run

# Starts argv[2:] in a session of its own, output to the log file argv[1], prints its pid and exits: the runner is
# then no descendant of the worker that started it, so a test that counts its own descendants (what an engine
# left running) never counts a zoo session's processes.
_DETACH = ("import subprocess, sys; "
           "print(subprocess.Popen(sys.argv[2:], stdout=open(sys.argv[1], 'w'), stderr=subprocess.STDOUT, "
           "stdin=subprocess.DEVNULL, start_new_session=True).pid)")

# The same environment whichever test asks first: no engine_ref plugin loaded.
_HERMETIC = {"ENGINE_REF_PLUGINS": ""}


@dataclass(frozen=True)
class ZooSession:
    """One finished ``pytest --enginecheck`` session: where it ran, its exit status, output and JSON report."""

    dir: Path
    returncode: int
    stdout: str
    stderr: str
    report: dict[str, Any]

    @property
    def results(self) -> dict[tuple[str, str], dict[str, Any]]:
        """The report's results by (architecture, item)."""
        return {(r["arch"], r["check"]): r for r in self.report["results"]}

    @property
    def result(self) -> pytest.RunResult:
        """The session as pytester's ``runpytest_subprocess`` returns one (``assert_outcomes``,
        ``stdout.fnmatch_lines``, ``outlines``)."""
        return pytest.RunResult(self.returncode, self.stdout.splitlines(), self.stderr.splitlines(), 0.0)


def shared_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The temp dir every pytest-xdist worker of this session sees (the parent of their base temp dirs)."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


def start_needed(tmp_path_factory: pytest.TempPathFactory, items: Iterable[pytest.Function]) -> None:
    """Start in the background each session of ``SESSIONS`` that one of ``items`` needs (it uses a fixture its
    module's ``ZOO_SESSIONS`` names) and that no worker of this test session has started or run yet; return at
    once."""
    needed = {name for item in items for fixture, name in getattr(item.module, "ZOO_SESSIONS", {}).items()
              if fixture in item.fixturenames}
    for name in sorted(needed):
        run_dir = _run_dir(tmp_path_factory, name)
        with open(run_dir / ".lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if (run_dir / "session.json").exists() or (run_dir / "runner.pid").exists():
                continue
            (run_dir / "spec.json").write_text(json.dumps({"args": list(SESSIONS[name]), "timeout": TIMEOUT}))
            # started before the root conftest's private ModelInfo cache is set: a private one of its own
            env = {"ENGINE_REF_CACHE_ROOT": str(run_dir / "engine_ref_cache"), **os.environ}
            launched = subprocess.run([sys.executable, "-c", _DETACH, str(run_dir / "runner.log"),
                                       sys.executable, "-m", "tests.zoo_sessions", str(run_dir)],
                                      cwd=Path(__file__).parents[1], env=env, capture_output=True, text=True,
                                      check=True, timeout=60)
            (run_dir / "runner.pid").write_text(launched.stdout.strip())


def stop_unfinished(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    """Kill, with their process trees, the background sessions of this test run that have not finished (the run
    stopped early: ``-x``, a failure in collection, Ctrl-C); called once the whole run ends. Returns their names."""
    import psutil

    stopped = []
    for pid_file in shared_dir(tmp_path_factory).glob("zoo-session-*/runner.pid"):
        if (pid_file.parent / "session.json").exists():
            continue
        try:
            runner = psutil.Process(int(pid_file.read_text()))
            tree = [runner, *runner.children(recursive=True)]
        except psutil.NoSuchProcess:
            continue
        for process in tree:
            with contextlib.suppress(psutil.NoSuchProcess):
                process.kill()
        psutil.wait_procs(tree, timeout=10)
        stopped.append(pid_file.parent.name)
    return stopped


def zoo_session(tmp_path_factory: pytest.TempPathFactory, name: str, *args: str,
                env: dict[str, str] | None = None, timeout: float = TIMEOUT) -> ZooSession:
    """The session ``name``: ``pytest -p no:cacheprovider --enginecheck --enginecheck-json=report.json *args`` in a
    copy of the zoo (importable: it is the PYTHONPATH; ``{dir}`` in an argument is that directory), with ``env``
    over this process's environment; run by the first caller of this test session (or in the background, where
    ``start_needed`` started it: then this waits for it), read back by the others. One name, one configuration."""
    run_dir = _run_dir(tmp_path_factory, name)
    done = run_dir / "session.json"
    with open(run_dir / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not done.exists() and not (run_dir / "runner.pid").exists():
            _write(done, _run(run_dir, args, env or {}, timeout))
    if not done.exists():
        _wait_for_runner(run_dir, timeout)
    session = json.loads(done.read_text())
    assert session["args"] == list(args), f"zoo session {name!r} is run with other arguments elsewhere"
    report = run_dir / "report.json"
    assert report.exists(), session["stdout"] + session["stderr"]
    return ZooSession(run_dir, session["returncode"], session["stdout"], session["stderr"],
                      json.loads(report.read_text()))


def _run_dir(tmp_path_factory: pytest.TempPathFactory, name: str) -> Path:
    run_dir = shared_dir(tmp_path_factory) / f"zoo-session-{name}"
    run_dir.mkdir(exist_ok=True)
    return run_dir


def _write(done: Path, session: dict[str, Any]) -> None:
    """Write session.json whole or not at all: a waiting worker reads it as soon as it exists."""
    partial = done.with_name(f".{done.name}.{os.getpid()}")
    partial.write_text(json.dumps(session))
    partial.replace(done)


def _wait_for_runner(run_dir: Path, timeout: float) -> None:
    """Wait for the background run of ``start_needed`` to write session.json; fail if its runner exits without it
    or the session outlives its own timeout (the runner's subprocess timeout, plus a minute to write)."""
    import psutil

    pid = int((run_dir / "runner.pid").read_text())
    deadline = time.monotonic() + timeout + 60
    while not (run_dir / "session.json").exists():
        try:
            running = psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            running = False
        if not running and not (run_dir / "session.json").exists():
            pytest.fail(f"the background zoo session in {run_dir} exited without its session.json: "
                        f"{(run_dir / 'runner.log').read_text()[-3000:]}")
        if time.monotonic() > deadline:
            pytest.fail(f"the background zoo session in {run_dir} did not finish within {timeout + 60:g} s")
        time.sleep(0.2)


def _run(run_dir: Path, args: tuple[str, ...], env: dict[str, str], timeout: float) -> dict[str, Any]:
    shutil.copytree(ZOO, run_dir, dirs_exist_ok=True, ignore=shutil.ignore_patterns("__pycache__"))
    out = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "--enginecheck",
                          f"--enginecheck-json={run_dir / 'report.json'}",
                          *(arg.replace("{dir}", str(run_dir)) for arg in args)],
                         cwd=run_dir, capture_output=True, text=True, timeout=timeout,
                         env={**os.environ, "PYTHONPATH": str(run_dir), **_HERMETIC, **env})
    return {"args": list(args), "returncode": out.returncode, "stdout": out.stdout, "stderr": out.stderr}


if __name__ == "__main__":  # start_needed's background run: python -m tests.zoo_sessions RUN_DIR
    _dir = Path(sys.argv[1])
    _spec = json.loads((_dir / "spec.json").read_text())
    try:
        _session = _run(_dir, tuple(_spec["args"]), {}, _spec["timeout"])
    except subprocess.TimeoutExpired as e:
        _session = {"args": _spec["args"], "returncode": -1, "stdout": str(e.stdout or ""),
                    "stderr": f"the session did not finish within {_spec['timeout']} s"}
    _write(_dir / "session.json", _session)
