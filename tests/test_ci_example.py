"""examples/github-actions.yml cannot run here: it is checked against GitHub's workflow schema (check-jsonschema's
vendored copy, from the test extra), and every ``run:`` script parses as bash."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

WORKFLOW = Path(__file__).parents[1] / "examples" / "github-actions.yml"
VALIDATOR = [sys.executable, "-m", "check_jsonschema", "--builtin-schema", "vendor.github-workflows"]
needs_validator = pytest.mark.skipif(importlib.util.find_spec("check_jsonschema") is None,
                                     reason="check-jsonschema is not installed (the test extra installs it)")


@needs_validator
def test_the_workflow_matches_githubs_schema() -> None:
    out = subprocess.run([*VALIDATOR, str(WORKFLOW)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr


@needs_validator
def test_the_validator_refuses_a_broken_workflow(tmp_path: Path) -> None:
    """So the test above can fail: a step with a misspelt key is refused."""
    broken = tmp_path / "broken.yml"
    broken.write_text(WORKFLOW.read_text().replace("      - name: Install\n        run:", "      - name: Install\n"
                                                                                         "        runs:", 1))
    out = subprocess.run([*VALIDATOR, str(broken)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 1 and "$.jobs.shard.steps[3]" in out.stdout, out.stdout + out.stderr


@needs_validator
def test_every_run_script_parses_as_bash(tmp_path: Path) -> None:
    from ruamel.yaml import YAML  # check-jsonschema's YAML parser

    workflow = YAML(typ="safe").load(WORKFLOW.read_text())
    scripts = [(job, step.get("name", "?"), step["run"]) for job, spec in workflow["jobs"].items()
               for step in spec["steps"] if "run" in step]
    assert len(scripts) >= 5
    for job, name, script in scripts:
        text = re.sub(r"\$\{\{.*?\}\}", "EXPR", script)  # GitHub's expressions are replaced before bash runs
        out = subprocess.run(["bash", "-n"], input=text, capture_output=True, text=True, timeout=30)
        assert out.returncode == 0, f"{job} / {name}: {out.stderr}"
