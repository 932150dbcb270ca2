"""Sharding the vLLM target with pytest-split (issue 20): a sample of the tier (the plugin distribution's clean
model, the one touching CUDA at import, in-tree Llama) split 2 ways by least duration and merged by ``python -m
pytest_enginecheck.report merge`` gives exactly the verdicts and messages of one unsplit run, and the exit status it
had. Import and inspect only: the engine checks' folding across shards is the zoo's test (tests/pytest_enginecheck/
test_sharding.py); here the items, node ids and durations are vLLM's."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("pytest_split", reason="pytest-split is not installed (.ci/vllm-venv installs it)")

SPLITS = 2
# import fails for EctpCuda (its inspect folds into it); every other item passes.
# (a timeout that a loaded machine does not reach: verdicts here are about the split, not about time)
RUN = ["-p", "no:cacheprovider", "--enginecheck", "--enginecheck-target=vllm", "-m", "enginecheck", "-q",
       "--enginecheck-checks=import,inspect", "--enginecheck-timeout=600", "-k",
       "EctpClean or EctpCuda or (LlamaForCausalLM and not Ectp and not Eagle)"]


def _pytest(run_dir: Path, site: Path, cache: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(site), "VLLM_PLUGINS": "clean,cuda_chain",
           "XDG_CACHE_HOME": str(cache)}  # one derived preload for the runs
    return subprocess.run([sys.executable, "-m", "pytest", *RUN, *args], cwd=run_dir, capture_output=True, text=True,
                          timeout=900, env=env)


def _verdicts(path: Path) -> dict[tuple[str, str], tuple[str, str]]:
    return {(r["arch"], r["check"]): (r["outcome"], r["message"]) for r in json.loads(path.read_text())["results"]}


def test_the_split_vllm_sample_merges_into_the_unsplit_run(tmp_path: Path, plugin_site: Path,
                                                          tmp_path_factory: pytest.TempPathFactory) -> None:
    cache = tmp_path_factory.getbasetemp() / "xdg-cache"  # test_vllm_target's too
    durations = tmp_path / "durations.json"
    whole = _pytest(tmp_path, plugin_site, cache, "--store-durations", f"--durations-path={durations}",
                    f"--enginecheck-json={tmp_path / 'whole.json'}")
    verdicts = _verdicts(tmp_path / "whole.json")
    outcomes = {item: outcome for item, (outcome, _) in verdicts.items()}
    assert outcomes[("EctpCudaForCausalLM", "import")] == "failed", whole.stdout
    assert outcomes[("EctpCudaForCausalLM", "inspect")] == "skipped", whole.stdout
    assert outcomes[("EctpCleanForCausalLM", "inspect")] == "passed", whole.stdout
    assert outcomes[("LlamaForCausalLM", "inspect")] == "passed", whole.stdout
    assert whole.returncode == 1, whole.stdout + whole.stderr

    shards = [tmp_path / f"shard{g}.json" for g in range(1, SPLITS + 1)]
    for g, shard in enumerate(shards, start=1):
        _pytest(tmp_path, plugin_site, cache, f"--splits={SPLITS}", f"--group={g}",
                "--splitting-algorithm=least_duration", f"--durations-path={durations}", f"--enginecheck-json={shard}")
    assert all(json.loads(shard.read_text())["results"] for shard in shards), "a group ran nothing"
    merged = subprocess.run([sys.executable, "-m", "pytest_enginecheck.report", "merge", *map(str, shards),
                             "--json", str(tmp_path / "merged.json"), "--expect", str(durations)],
                            capture_output=True, text=True, timeout=120)
    assert _verdicts(tmp_path / "merged.json") == verdicts, merged.stdout + merged.stderr
    assert merged.returncode == whole.returncode, merged.stdout + merged.stderr
    assert "duplicate:" not in merged.stdout and "missing:" not in merged.stdout, merged.stdout
