"""The startup trace: Chrome trace-event JSON (Perfetto, chrome://tracing) from ``engine-ref startup --trace``
and ``pytest --enginecheck --enginecheck-trace=DIR``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

WORKER_STEPS = {"init_device": "executor", "load_model": "executor", "profile_run": "kv_cache",
                "initialize_cache": "kv_cache"}


def _slices(trace: dict[str, Any], tid: int) -> dict[str, dict[str, Any]]:
    return {e["name"]: e for e in trace["traceEvents"] if e["ph"] == "X" and e["tid"] == tid}


def _inside(inner: dict[str, Any], outer: dict[str, Any]) -> bool:
    return outer["ts"] <= inner["ts"] and inner["ts"] + inner["dur"] <= outer["ts"] + outer["dur"]


def check_trace(trace: dict[str, Any], tp: int) -> None:
    """A loadable trace: complete events on integer pid/tid tracks, one named track per rank, steps nested."""
    events = trace["traceEvents"]
    assert all(isinstance(e["pid"], int) and e["ph"] in ("X", "M") for e in events)
    names = {e["tid"]: e["args"]["name"] for e in events if e["name"] == "thread_name"}
    assert names[0].startswith("EngineCore (pid ")
    assert [names[r + 1].split(" (")[0] for r in range(tp)] == [f"rank {r}" for r in range(tp)]
    engine = _slices(trace, 0)
    assert list(engine) == ["plugins", "config", "executor", "kv_cache", "ready"]
    for rank in range(tp):
        steps = _slices(trace, rank + 1)
        for step, phase in WORKER_STEPS.items():
            assert _inside(steps[step], engine[phase]), (rank, step)
        reads = [e for name, e in steps.items() if name.startswith("read ")]
        assert reads and all(_inside(r, steps["load_model"]) for r in reads)
        assert sum(r["args"]["bytes"] for r in reads) > 0 and all(r["args"]["read_s"] >= 0 for r in reads)


def test_cli_startup_writes_a_trace_per_rank(tmp_path: Path) -> None:
    trace_file = tmp_path / "startup.json"
    out = subprocess.run([sys.executable, "-m", "engine_ref.entrypoints.cli", "startup", "LlamaForCausalLM", "-tp", "2",
                          "--device-memory", "256MiB", "--max-model-len", "64", "--trace", str(trace_file)],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert f"startup trace written to {trace_file}" in out.stderr and "ui.perfetto.dev" in out.stderr
    check_trace(json.loads(trace_file.read_text()), tp=2)


def test_enginecheck_trace_dir_holds_one_trace_per_engine_start(pytester: pytest.Pytester) -> None:
    trace_dir = pytester.path / "traces"
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "--enginecheck", "--enginecheck-checks=startup",
                                           f"--enginecheck-trace={trace_dir}", "-k", "LlamaForCausalLM")
    result.assert_outcomes(passed=1)
    (trace_file,) = trace_dir.glob("startup-LlamaForCausalLM-tp2-*.json")
    check_trace(json.loads(trace_file.read_text()), tp=2)


def test_enginecheck_trace_ini_twin(pytester: pytest.Pytester) -> None:
    pytester.makeini("[pytest]\nenginecheck_trace = from-ini\n")
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "--enginecheck", "--enginecheck-checks=startup",
                                           "-k", "Qwen2ForCausalLM")
    result.assert_outcomes(passed=1)
    assert len(os.listdir(pytester.path / "from-ini")) == 1
