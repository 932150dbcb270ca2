"""Sharding with pytest-split: the zoo's root-cause registry split 3 ways (least-duration, from durations a first
run stored) gives, merged by ``python -m pytest_enginecheck.report merge``, exactly the verdicts and messages of
one unsplit run, although some checks are folded into a root that ran in another shard. The unsplit run is the
zoo.root_causes session test_checks and test_html_report read too (tests/zoo_sessions.py), which stores the
durations."""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.zoo_sessions import ROOT_CAUSES, zoo_session

# the fixture that reads a shared zoo session -> its name (started early: tests/zoo_sessions.py)
ZOO_SESSIONS = {"runs": "root-causes"}

pytest.importorskip("pytest_split", reason="pytest-split is not installed (the test extra installs it)")

ZOO = Path(__file__).parents[1] / "plugin_zoo"
RUN = ["-p", "no:cacheprovider", "--enginecheck", "--enginecheck-target=zoo.root_causes:REGISTRY",
       "--enginecheck-checks=import,inspect,load,budget,startup", "-q"]
SPLITS = 3


def _pytest(run_dir: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "pytest", *RUN, *args], cwd=run_dir, capture_output=True, text=True,
                          timeout=600, env={**os.environ, "PYTHONPATH": str(run_dir), "ENGINE_REF_PLUGINS": ""})


def _verdicts(path: Path) -> dict[tuple[str, str], tuple[str, str]]:
    return {(r["arch"], r["check"]): (r["outcome"], r["message"]) for r in json.loads(path.read_text())["results"]}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The unsplit run (the shared session, storing pytest-split's durations), then the 3 groups and their merge:
    once per session, under a file lock, whichever pytest-xdist worker asks first. The shards run in the unsplit
    run's directory (the messages name the zoo's files by their paths)."""
    whole = zoo_session(tmp_path_factory, "root-causes", *ROOT_CAUSES)
    assert set(RUN[3:-1]) <= set(ROOT_CAUSES), "the shards run the unsplit run's target and checks"
    run_dir = whole.dir
    done = run_dir / "runs.json"
    with open(run_dir / ".sharding-lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not done.exists():
            shutil.copyfile(whole.dir / "report.json", run_dir / "whole.json")
            done.write_text(json.dumps(_run_all(run_dir, whole.dir / "durations.json")))
    return {**json.loads(done.read_text()), "whole": {"returncode": whole.returncode, "stdout": whole.stdout},
            "dir": run_dir, "durations": whole.dir / "durations.json"}


def _run_all(run_dir: Path, durations: Path) -> dict[str, Any]:
    for g in range(1, SPLITS + 1):
        _pytest(run_dir, f"--splits={SPLITS}", f"--group={g}", "--splitting-algorithm=least_duration",
                f"--durations-path={durations}", f"--enginecheck-json={run_dir / f'shard{g}.json'}")
    merged = subprocess.run([sys.executable, "-m", "pytest_enginecheck.report", "merge",
                             *(str(run_dir / f"shard{g}.json") for g in range(1, SPLITS + 1)),
                             "--json", str(run_dir / "merged.json"), "--junitxml", str(run_dir / "merged.xml"),
                             "--expect", str(durations)], capture_output=True, text=True, timeout=120)
    return {"merged": {"returncode": merged.returncode, "stdout": merged.stdout + merged.stderr}}


def test_split_and_merged_verdicts_equal_the_unsplit_run(runs: dict[str, Any]) -> None:
    run_dir = runs["dir"]
    assert (run_dir / "merged.json").exists(), runs["merged"]["stdout"]
    whole = _verdicts(run_dir / "whole.json")
    assert len(whole) == 14 and any(outcome == "failed" for outcome, _ in whole.values()), runs["whole"]["stdout"]
    assert _verdicts(run_dir / "merged.json") == whole, runs["merged"]["stdout"]
    # the exit status a single run had, and nothing called out
    assert runs["merged"]["returncode"] == runs["whole"]["returncode"] == 1, runs["merged"]["stdout"]
    assert "duplicate:" not in runs["merged"]["stdout"] and "missing:" not in runs["merged"]["stdout"]


def test_some_checks_fold_into_a_root_that_ran_in_another_shard(runs: dict[str, Any]) -> None:
    """Else the test above would not exercise the rerun of an unknown root (runner.run_item's failure path)."""
    run_dir = runs["dir"]
    shard_of = {}
    for g in range(1, SPLITS + 1):
        for r in json.loads((run_dir / f"shard{g}.json").read_text())["results"]:
            shard_of[f"enginecheck::{r['arch']}::{r['check']}"] = g
    assert sorted(set(shard_of.values())) == list(range(1, SPLITS + 1)), "a group ran nothing"
    elsewhere = [(item, r["detail"]["root"]) for g in range(1, SPLITS + 1)
                 for r in json.loads((run_dir / f"shard{g}.json").read_text())["results"]
                 if r["detail"].get("kind") == "dependency"
                 and shard_of[r["detail"]["root"]] != g
                 for item in [f"enginecheck::{r['arch']}::{r['check']}"]]
    assert elsewhere, shard_of


def test_node_ids_and_durations_are_those_of_every_shard(runs: dict[str, Any]) -> None:
    """pytest-split stored a duration per check item, under the node ids the shards report (stable across runs)."""
    durations = json.loads(runs["durations"].read_text())
    run_dir = runs["dir"]
    ids = {f"enginecheck::{r['arch']}::{r['check']}" for g in range(1, SPLITS + 1)
           for r in json.loads((run_dir / f"shard{g}.json").read_text())["results"]}
    assert {i for i in durations if i.startswith("enginecheck::")} == ids
    assert all(durations[i] > 0 for i in ids)


def test_the_merged_junit_xml_has_one_case_per_item(runs: dict[str, Any]) -> None:
    import xml.etree.ElementTree as ET

    whole = _verdicts(runs["dir"] / "whole.json")
    suite = ET.parse(runs["dir"] / "merged.xml").getroot().find("testsuite")
    assert suite is not None
    counts = {o: sum(outcome == o for outcome, _ in whole.values()) for o in ("failed", "skipped")}
    assert (suite.get("tests"), suite.get("failures"), suite.get("skipped")) == (
        str(len(whole)), str(counts["failed"]), str(counts["skipped"]))
    failed = {(c.get("classname"), c.get("name")) for c in suite.iter("testcase") if c.find("failure") is not None}
    assert failed == {(f"enginecheck.{arch}", check) for (arch, check), (outcome, _) in whole.items()
                      if outcome == "failed"}
    assert ("enginecheck.BrokenBuildLlamaForCausalLM", "load[tp=1]") in failed


def test_multi_rank_items_share_one_xdist_group(tmp_path: Path) -> None:
    """``--dist loadgroup`` runs the items that start more than one rank (TP=N, and startup at the largest TP size)
    in one worker, one at a time; TP=1 items stay free to spread."""
    pytest.importorskip("xdist", reason="pytest-xdist is not installed (the test extra installs it)")
    shutil.copytree(ZOO, tmp_path, dirs_exist_ok=True, ignore=shutil.ignore_patterns("__pycache__"))
    out = _pytest(tmp_path, "--collect-only", "-m", "xdist_group", "--enginecheck-checks=import,load,startup")
    grouped = sorted(line.split("::", 2)[2] for line in out.stdout.splitlines()
                     if line.startswith("enginecheck::BrokenBuild"))
    assert grouped == ["load[tp=2]", "startup"], out.stdout + out.stderr
