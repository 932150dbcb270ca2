"""``python -m pytest_enginecheck.fit`` without vLLM: bad input exits 2 with a message naming the value and the fix,
never a traceback; vLLM's own refusals are turned into the same kind of message (``engine_config.refusal``)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from pytest_enginecheck.targets.vllm.fit import FitError
from pytest_enginecheck.targets.vllm.fit.engine_config import (
    ServeArgs,
    _first_line,
    cuda_dtype,
    read_config,
    refusal,
    serve_defaults,
)
from pytest_enginecheck.targets.vllm.fit.estimates import GiB

LLAMA = Path(__file__).resolve().parents[3] / "engine_ref" / "model_executor" / "models" / "configs" / (
    "Llama-3.1-8B.json")


def _fit(*args: str, engine: str = "vllm") -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "pytest_enginecheck.fit", *args, "--engine", engine],
                          capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize(("args", "message"), [
    (("nowhere/config.json", "--gpu-memory", "80GiB"),
     "error: 'nowhere/config.json' is neither a config.json file nor a directory holding one; give the path"),
    ((str(LLAMA), "--gpu-memory", "80 gigs"), "error: gpu_memory='80 gigs' is not a size; write a number with a "
                                              "unit such as '8GiB'"),
    ((str(LLAMA), "--gpu-memory", "80GiB", "--gpu-memory-utilization", "1.5"),
     "error: gpu_memory_utilization=1.5: give a fraction in (0, 1], e.g. 0.9"),
    ((str(LLAMA), "--gpu-memory", "80GiB", "--tp", "0"), "error: tensor_parallel_size=0: give a positive number"),
    ((str(LLAMA), "--gpu-memory", "80GiB", "--max-model-len", "-1"), "error: max_model_len=-1: give a positive"),
])
def test_bad_input_exits_2_naming_the_value_and_the_fix(args: tuple[str, ...], message: str) -> None:
    result = _fit(*args)
    assert result.returncode == 2, result
    assert message in result.stderr
    assert "Traceback" not in result.stderr and result.stdout == ""


@pytest.mark.parametrize(("engine", "message"), [
    ("nosuch", "error: --engine='nosuch' is not an installed target; use one of "),
    ("sglang", "error: --engine='sglang': that target predicts no full-size fit (it has no "
               "pytest_enginecheck.targets.sglang.fit.command)"),
])
def test_the_engine_is_a_target_that_predicts_the_fit(engine: str, message: str) -> None:
    result = _fit(str(LLAMA), "--gpu-memory", "80GiB", engine=engine)
    assert result.returncode == 2, result
    assert message in result.stderr
    assert "Traceback" not in result.stderr and result.stdout == ""


def test_a_config_that_is_not_a_models_config_is_refused(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(FitError, match="is not a JSON config"):
        read_config(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 8}))
    with pytest.raises(FitError, match='names no "architectures"'):
        read_config(tmp_path / "config.json")


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vLLM is installed here")
def test_without_vllm_the_command_says_where_to_run_it() -> None:
    result = _fit(str(LLAMA), "--gpu-memory", "80GiB")
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "vLLM is not importable here" in result.stderr
    assert "Run this command with the Python of an environment that has vLLM installed" in result.stderr


def test_vllms_refusals_keep_its_words_and_add_the_fix() -> None:
    pydantic = ("1 validation error for ModelConfig\n  Value error, Total number of attention heads (64) must be "
                "divisible by tensor parallel size (3). [type=value_error, input_value=ArgsKwargs((), {...}), "
                "input_type=ArgsKwargs]\n    For further information visit https://errors.pydantic.dev/2.14/v/value")
    message = _first_line(ValueError(pydantic))
    assert message == "Total number of attention heads (64) must be divisible by tensor parallel size (3)."
    assert refusal("LlamaForCausalLM", ServeArgs(tensor_parallel_size=3), message) == (
        "vLLM refuses LlamaForCausalLM at tensor_parallel_size=3: Total number of attention heads (64) must be "
        "divisible by tensor parallel size (3). Fix: give a --tp that divides it.")
    unknown = refusal("NoSuchForCausalLM", ServeArgs(), "Model architectures ['NoSuchForCausalLM'] are not supported "
                                                        "for now. Supported architectures: dict_keys([...])")
    assert "Supported architectures" not in unknown and "Fix: check config.json's \"architectures\"" in unknown


def test_the_gpus_defaults_stand_in_for_the_cpu_platforms() -> None:
    assert cuda_dtype({"torch_dtype": "float32"}, "auto") == "bfloat16"  # vLLM on CUDA: float32 checkpoints in bf16
    assert cuda_dtype({"torch_dtype": "float16"}, "auto") == "float16"
    assert cuda_dtype({"text_config": {"torch_dtype": "bfloat16"}}, "auto") == "bfloat16"
    assert cuda_dtype({"torch_dtype": "bfloat16"}, "float16") == "float16"
    assert serve_defaults(80 * GiB) == (8192, 1024)  # vllm serve on an H100
    assert serve_defaults(141 * 10**9) == (8192, 1024) and serve_defaults(192 * GiB) == (16384, 1024)
    assert serve_defaults(24 * GiB) == (2048, 256)
