"""What an author reads after a verdict (pytest_enginecheck/output.py): a check's captured output without warnings,
progress bars and known noise, a failure's traceback cut after the author's last frame, and everything with
ENGINECHECK_FULL_OUTPUT=1 (or ENGINECHECK_VLLM_LOG=full, its older name). VLLM_STDERR's lines are those vLLM's CPU
backend prints (from the format strings in its source and its _C library) around two lines captured from
zoo/library_raises.py's run; ENGINE_REF_TRACE is a real traceback of that run, shortened."""

from __future__ import annotations

import importlib
import json
import os
import re
import shutil
import sys
import traceback
from pathlib import Path

import pytest

from pytest_enginecheck.output import Authorship, full_output, trimmed_output, trimmed_traceback, without_noise

ZOO = Path(__file__).parents[1] / "plugin_zoo"
SHOWS_ALL = "ENGINECHECK_FULL_OUTPUT=1 shows them"

VLLM_STDERR = """\
/venv/lib/python3.12/site-packages/torch/cuda/__init__.py:61: FutureWarning: The pynvml package is deprecated. \
Please install nvidia-ml-py instead.
  import pynvml  # type: ignore[import]
(vllm-rank-1 pid=4242) WARNING 12-02 01:48:09 [cpu_worker.py:51] Node 0 is not in available memory nodes [1].
NUMA binding: Using MEMBIND policy for memory allocation on the NUMA nodes (0). Memory allocations will be strictly \
bound to these NUMA nodes.
numa_set_membind failed. errno: 1
(vllm-rank-0 pid=4241) WARNING 12-02 01:48:09 [system_utils.py:35] Overwriting environment variable LD_PRELOAD from \
'' to '/usr/lib/libtcmalloc_minimal.so.4'
Loading safetensors checkpoint shards:   0% Completed | 0/1 [00:00<?, ?it/s]
Loading safetensors checkpoint shards: 100% Completed | 1/1 [00:00<00:00, 61.20it/s]

/tmp/zoo/library_raises.py:39: FutureWarning: NoActLlamaForCausalLM: `rope_scaling['type']` is deprecated
  warnings.warn(f"{type(self).__name__}: `rope_scaling['type']` is deprecated, use `rope_type`", FutureWarning,
Loading zoo weights:   0%|          | 0/21 [00:00<?, ?it/s]\rLoading zoo weights: 100%|██████████| 21/21 \
[00:00<00:00, 10736.27it/s]
(vllm-rank-1 pid=4242) ERROR 12-02 01:48:12 [core.py:9] EngineCore failed to start.
(enginecheck: 5 lines of vllm-rank-1's output (vLLM's log not about this outcome, ...) left out; ...)
Fatal Python error: Segmentation fault
"""


def test_warnings_progress_bars_and_known_noise_go_in_one_counted_line(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ENGINECHECK_FULL_OUTPUT", raising=False)
    monkeypatch.delenv("ENGINECHECK_VLLM_LOG", raising=False)
    lines = VLLM_STDERR.splitlines()
    assert trimmed_output(VLLM_STDERR).splitlines() == [
        lines[-3], lines[-2], lines[-1],
        f"(enginecheck: 12 lines of Python warnings, progress bars and known noise left out; {SHOWS_ALL})"]
    assert without_noise(["  indented, but after no warning", "x.py:3: UserWarning: w", "  w()", "  kept"]) == (
        ["  indented, but after no warning", "  kept"], 2)
    assert trimmed_output("") == "" and trimmed_output("just this\n") == "just this\n"


@pytest.mark.parametrize("variable, value", [("ENGINECHECK_FULL_OUTPUT", "1"), ("ENGINECHECK_VLLM_LOG", "full")])
def test_the_full_output_variable_and_its_vllm_alias_keep_everything(monkeypatch: pytest.MonkeyPatch, variable: str,
                                                                     value: str) -> None:
    monkeypatch.delenv("ENGINECHECK_FULL_OUTPUT", raising=False)
    monkeypatch.delenv("ENGINECHECK_VLLM_LOG", raising=False)
    assert not full_output()
    monkeypatch.setenv(variable, value)
    assert full_output()
    assert trimmed_output(VLLM_STDERR) == VLLM_STDERR
    assert trimmed_traceback(ENGINE_REF_TRACE, _author) == ENGINE_REF_TRACE
    monkeypatch.setenv("ENGINECHECK_FULL_OUTPUT", "0")
    assert full_output() == (variable == "ENGINECHECK_VLLM_LOG")


ENGINE_REF_TRACE = """\
Traceback (most recent call last):
  File "/work/main/pytest_enginecheck/checks/runner.py", line 82, in run_in_child
    detail = check_function(ctx)(ctx)
             ^^^^^^^^^^^^^^^^^^^^^^^^
  File "/work/main/pytest_enginecheck/targets/engine_ref/load_check.py", line 118, in run
    outputs, report = greedy(ctx, ckpt, ctx.tp)
                      ^^^^^^^^^^^^^^^^^^^^^^^^^
  File "/work/main/engine_ref/worker/model_runner.py", line 50, in _run
    hidden_states = self.model(input_ids, positions, **kwargs)
                    ^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^
  File "/work/main/.venv/lib/python3.11/site-packages/torch/nn/modules/module.py", line 1789, in _call_impl
    return forward_call(*args, **kwargs)
           ^^^^^^^^^^^^^^^^^^^^^^^^^^^^^
  File "/tmp/trimrun/zoo/library_raises.py", line 38, in forward
    return self.down_proj(gate_up)  # the bug: act_fn(gate_up) forgotten
           ^^^^^^^^^^^^^^^^^^^^^^^
  File "/work/main/.venv/lib/python3.11/site-packages/torch/nn/modules/module.py", line 1789, in _call_impl
    return forward_call(*args, **kwargs)
           ^^^^^^^^^^^^^^^^^^^^^^^^^^^^^
  File "/work/main/engine_ref/model_executor/layers/linear.py", line 218, in forward
    out = self.quant_method.apply(self, x)
          ^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^
  File "/work/main/engine_ref/model_executor/layers/linear.py", line 68, in apply
    return F.linear(x, layer.weight, bias)
           ^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^
RuntimeError: mat1 and mat2 shapes cannot be multiplied (2048x256 and 128x64)
"""


def _author(file: str) -> bool:
    return "/zoo/" in file


def _harness(file: str) -> bool:
    return "/pytest_enginecheck/" in file


def test_a_traceback_ends_at_the_authors_last_frame(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ENGINECHECK_FULL_OUTPUT", raising=False)
    monkeypatch.delenv("ENGINECHECK_VLLM_LOG", raising=False)
    lines = ENGINE_REF_TRACE.splitlines()
    assert trimmed_traceback(ENGINE_REF_TRACE, _author, _harness).splitlines() == [
        lines[0], f"  (2 pytest-enginecheck frames not shown; {SHOWS_ALL})", *lines[7:16],
        f"  (3 library frames not shown; {SHOWS_ALL})", lines[-1]]
    assert trimmed_traceback(ENGINE_REF_TRACE, lambda file: False) == ENGINE_REF_TRACE  # never the author's: whole
    assert trimmed_traceback("no traceback\n", _author) == "no traceback\n"


def _chained_failure(tmp_path: Path) -> str:
    """A real traceback: the author's module (in ``tmp_path``) calls the standard library's json on bad input, and
    what called it wraps the error in another exception."""
    (tmp_path / "author_pkg").mkdir()
    (tmp_path / "author_pkg" / "__init__.py").write_text("")
    (tmp_path / "author_pkg" / "model.py").write_text("import json\n\n\ndef forward(x):\n    return json.loads(x)\n")
    sys.path.insert(0, str(tmp_path))
    try:
        model = importlib.import_module("author_pkg.model")
        try:
            try:
                model.forward("{")
            except ValueError as e:
                raise RuntimeError("the engine failed to start") from e
        except RuntimeError:
            return traceback.format_exc()
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop("author_pkg.model", None)
        sys.modules.pop("author_pkg", None)
    raise AssertionError("it raised nothing")


def test_a_chained_traceback_keeps_the_authors_block_and_the_exceptions(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ENGINECHECK_FULL_OUTPUT", raising=False)
    text = _chained_failure(tmp_path)
    authorship = Authorship("author_pkg.model")
    assert authorship(str(tmp_path / "author_pkg" / "model.py")) and not authorship(json.__file__)

    def harness(file: str) -> bool:  # this test file stands for the plugin that called the author's code
        return file == __file__

    trimmed = trimmed_traceback(text, lambda file: authorship(file) and not harness(file), harness)
    root, wrapper = trimmed.split("\nThe above exception was the direct cause of the following exception:\n")
    assert root.splitlines()[:4] == [
        "Traceback (most recent call last):",
        f"  (1 pytest-enginecheck frame not shown; {SHOWS_ALL})",
        f'  File "{tmp_path / "author_pkg" / "model.py"}", line 5, in forward',
        "    return json.loads(x)"]
    assert re.search(rf"\n  \(\d+ library frames not shown; {SHOWS_ALL}\)\njson.decoder.JSONDecodeError: ", root), root
    assert "json/decoder.py" in text and "json/" not in root  # json's own frames, below the author's
    assert wrapper.strip().splitlines() == [  # what wrapped it never reaches the author's code: its frames go
        "Traceback (most recent call last):",
        f"  (1 library frame not shown; {SHOWS_ALL})",
        "RuntimeError: the engine failed to start"]


def test_the_authors_frames_are_the_models_module_and_code_outside_the_engine_and_libraries() -> None:
    import torch

    import engine_ref

    engine = Path(engine_ref.__file__).parent
    zoo = Authorship("zoo.library_raises", ("engine_ref",))
    assert zoo("/tmp/run/zoo/library_raises.py") and zoo("/tmp/run/zoo/base.py")  # the author's other code too
    assert not zoo(str(engine / "model_executor" / "layers" / "linear.py"))  # the engine's
    assert not zoo(torch.__file__) and not zoo(json.__file__) and not zoo("<frozen importlib._bootstrap>")
    assert not zoo(str(Path(__file__).parents[2] / "pytest_enginecheck" / "checks" / "runner.py"))
    bundled = Authorship("engine_ref.model_executor.models.llama", ("engine_ref",))  # a model inside the engine
    assert bundled(str(engine / "model_executor" / "models" / "llama.py"))
    assert not bundled(str(engine / "model_executor" / "layers" / "linear.py"))
    plugin = Authorship("ectp.models.scaled_shard", ("vllm",))  # a vLLM plugin installed into site-packages
    assert plugin("/venv/lib/python3.12/site-packages/ectp/models/layers.py")
    assert not plugin("/venv/lib/python3.12/site-packages/vllm/model_executor/layers/linear.py")
    assert not plugin("/home/u/ectp/.venv/lib/python3.12/site-packages/torch/nn/modules/module.py")


@pytest.fixture
def zoo(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> pytest.Pytester:
    """pytester's directory holding the zoo package, importable by the checks' processes; no engine_ref plugin."""
    shutil.copytree(ZOO, pytester.path, dirs_exist_ok=True, ignore=shutil.ignore_patterns("__pycache__"))
    pytester.makeini("[pytest]\npythonpath = .\n")
    monkeypatch.setenv("ENGINE_REF_PLUGINS", "")
    monkeypatch.delenv("ENGINECHECK_FULL_OUTPUT", raising=False)
    monkeypatch.delenv("ENGINECHECK_VLLM_LOG", raising=False)
    return pytester


def test_a_failed_item_shows_the_authors_frame_and_no_noise_and_all_of_it_on_request(
        zoo: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    """zoo/library_raises.py: the author's MLP forward hands down_proj a tensor of the wrong width; torch raises
    frames below it. Both architectures print a FutureWarning and a progress bar; -rA would show a passing item's."""
    args = ("-p", "no:cacheprovider", "--enginecheck", "--enginecheck-target=zoo.library_raises:REGISTRY",
            "--enginecheck-checks=load", "--enginecheck-tp=1", "-rA")
    result = zoo.runpytest_subprocess(*args, timeout=300)
    result.assert_outcomes(passed=1, failed=1)
    out = result.stdout.str()
    authors = re.search(r'  File "[^"]*zoo/library_raises\.py", line \d+, in forward\n'
                        r"    return self\.down_proj\(gate_up\)  # the bug: act_fn\(gate_up\) forgotten\n"
                        r"(?: +\^+\n)?"
                        rf"  \(\d+ library frames not shown; {SHOWS_ALL}\)\n"
                        r"RuntimeError: mat1 and mat2 shapes cannot be multiplied", out)
    assert authors, out
    assert f"pytest-enginecheck frames not shown; {SHOWS_ALL}" in out
    assert "layers/linear.py" not in out and "checks/runner.py" not in out, out
    assert "FutureWarning" not in out and "Loading zoo weights" not in out, out
    assert out.count(f"4 lines of Python warnings, progress bars and known noise left out; {SHOWS_ALL}") == 1, out

    monkeypatch.setenv("ENGINECHECK_FULL_OUTPUT", "1")
    full = zoo.runpytest_subprocess(*args, timeout=300)
    full.assert_outcomes(passed=1, failed=1)
    out = full.stdout.str()
    assert "engine_ref/model_executor/layers/linear.py" in out and "checks/runner.py" in out, out
    assert "FutureWarning: NoActLlamaForCausalLM" in out and "FutureWarning: NoisyLlamaForCausalLM" in out, out
    assert "Loading zoo weights: 100%" in out and "not shown" not in out and "left out" not in out, out
    assert os.environ.get("ENGINECHECK_FULL_OUTPUT") == "1"
