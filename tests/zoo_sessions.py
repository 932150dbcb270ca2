"""``pytest --enginecheck`` sessions over the zoo (tests/plugin_zoo) shared by the tests that only read their
results: each distinct configuration runs once per test session, whichever pytest-xdist worker asks first (under a
file lock in the temp dir the workers' base temp dirs share), and every test gets its exit status, output and JSON
report. A test that needs a session of its own (an option's effect, a usage error, xdist against serial) starts
its own; these are the runs several test modules would otherwise repeat."""

from __future__ import annotations

import fcntl
import importlib.util
import json
import os
import shutil
import subprocess
import sys
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


def zoo_session(tmp_path_factory: pytest.TempPathFactory, name: str, *args: str,
                env: dict[str, str] | None = None, timeout: float = 900) -> ZooSession:
    """The session ``name``: ``pytest -p no:cacheprovider --enginecheck --enginecheck-json=report.json *args`` in a
    copy of the zoo (importable: it is the PYTHONPATH; ``{dir}`` in an argument is that directory), with ``env``
    over this process's environment; run by the first caller of this test session, read back by the others. One
    name, one configuration."""
    run_dir = shared_dir(tmp_path_factory) / f"zoo-session-{name}"
    run_dir.mkdir(exist_ok=True)
    done = run_dir / "session.json"
    with open(run_dir / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not done.exists():
            done.write_text(json.dumps(_run(run_dir, args, env or {}, timeout)))
    session = json.loads(done.read_text())
    assert session["args"] == list(args), f"zoo session {name!r} is run with other arguments elsewhere"
    report = run_dir / "report.json"
    assert report.exists(), session["stdout"] + session["stderr"]
    return ZooSession(run_dir, session["returncode"], session["stdout"], session["stderr"],
                      json.loads(report.read_text()))


def _run(run_dir: Path, args: tuple[str, ...], env: dict[str, str], timeout: float) -> dict[str, Any]:
    shutil.copytree(ZOO, run_dir, dirs_exist_ok=True, ignore=shutil.ignore_patterns("__pycache__"))
    out = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "--enginecheck",
                          f"--enginecheck-json={run_dir / 'report.json'}",
                          *(arg.replace("{dir}", str(run_dir)) for arg in args)],
                         cwd=run_dir, capture_output=True, text=True, timeout=timeout,
                         env={**os.environ, "PYTHONPATH": str(run_dir), **_HERMETIC, **env})
    return {"args": list(args), "returncode": out.returncode, "stdout": out.stdout, "stderr": out.stderr}
