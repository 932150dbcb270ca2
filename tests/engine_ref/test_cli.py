"""The engine-ref command line, run as a real process (``python -m engine_ref.entrypoints.cli``).

Each process pays a torch import (about 2 s), so the module starts its commands together in one
fixture and each test waits for its own. Further error cases call ``main(argv)`` in this process:
the same code path, without another interpreter.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from engine_ref.entrypoints.cli import main
from tests.helpers import ARCHITECTURES, LLAMA

SMALL = ["--max-model-len", "64", "--max-num-batched-tokens", "64", "--device-memory", "64MiB"]
Run = Callable[[str], subprocess.CompletedProcess[str]]


def start(*args: str, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    """Start ``engine-ref ARGS`` in a fresh interpreter (it inherits this session's model-info cache)."""
    return subprocess.Popen([sys.executable, "-m", "engine_ref.entrypoints.cli", *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=None if env is None else {**os.environ, **env})


def finish(process: subprocess.Popen[str]) -> subprocess.CompletedProcess[str]:
    try:
        stdout, stderr = process.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        process.kill()
        process.communicate()
        raise
    return subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr)


@pytest.fixture(scope="module")
def qwen2_target(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("cli") / "qwen2"


@pytest.fixture(scope="module")
def run(llama: Path, qwen2_target: Path) -> Iterator[Run]:
    """``run(name)``: the finished process of one of the module's commands, all started at once; those that start
    no engine process (a usage error, or an engine at TP=1, which runs in the CLI's own process) run as
    ``main(argv)`` in this process while the others run: the same code path, without an interpreter each."""
    from engine_ref.model_executor.models.registry import ModelRegistry

    processes = {  # this one never asks the registry for a ModelInfo
        "make-checkpoint": start("make-checkpoint", "Qwen2ForCausalLM", str(qwen2_target), "--num-shards", "2"),
    }
    ModelRegistry.inspect_model_cls(LLAMA)  # fill the shared ModelInfo cache once, before the others look
    processes["startup"] = start("startup", LLAMA, *SMALL)
    in_process = {
        "missing dir": run_main(["startup", str(qwen2_target.parent / "does-not-exist")], None),
        "tp 3": run_main(["startup", str(llama), "--tensor-parallel-size", "3"], None),
        "startup --json": run_main(["startup", str(llama), *SMALL, "--json"], None),
    }
    yield lambda name: in_process[name] if name in in_process else finish(processes[name])
    for process in processes.values():
        if process.poll() is None:
            process.kill()
            process.communicate()


def test_startup_of_an_architecture_prints_the_table(run: Run) -> None:
    """A registered architecture name starts a tiny checkpoint made in a temporary directory."""
    result = run("startup")
    assert result.returncode == 0, result.stderr
    out = result.stdout
    match = re.search(rf"^{LLAMA} from (\S+)$", out, re.MULTILINE)
    assert match, out
    assert not Path(match.group(1)).exists()  # the temporary checkpoint is removed
    assert "tensor_parallel_size=1 executor=uni max_model_len=64" in out
    for phase in ("plugins", "config", "executor", "kv_cache", "ready", "total"):
        assert re.search(rf"^{phase}\s+\d+\.\d{{3}}$", out, re.MULTILINE), f"no {phase} row in\n{out}"
    assert re.search(r"^rank\s+pid\s+device\s+load s\s+read\s+weights\s+buffers\s+activations\s+KV cache\s+total"
                     r"\s+capacity$", out, re.MULTILINE), out
    assert re.search(r"^0\s+\d+\s+cpu\s+.*\b64\.00 MiB$", out, re.MULTILINE), out


def test_startup_json(run: Run, llama: Path) -> None:
    result = run("startup --json")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["architecture"] == LLAMA and report["model"] == str(llama)
    assert list(report["phases"]) == ["plugins", "config", "executor", "kv_cache", "ready"]
    [worker] = report["workers"]
    memory = worker["memory"]
    assert memory["capacity"] == 64 * 1024**2
    assert memory["weights"] > 0 and memory["activation_peak"] > 0 and memory["kv_cache"] > 0
    assert memory["buffers"] > 0
    assert memory["total"] == memory["weights"] + memory["buffers"] + memory["activation_peak"] + memory["kv_cache"]
    assert worker["bytes_read"] > 0 and worker["pid"] > 0


def test_make_checkpoint(run: Run, qwen2_target: Path) -> None:
    result = run("make-checkpoint")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == f"wrote Qwen2ForCausalLM checkpoint to {qwen2_target}"
    assert json.loads((qwen2_target / "config.json").read_text())["architectures"] == ["Qwen2ForCausalLM"]
    index = json.loads((qwen2_target / "model.safetensors.index.json").read_text())
    assert sorted(set(index["weight_map"].values())) == [
        "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    assert all((qwen2_target / shard).is_file() for shard in index["weight_map"].values())


def test_list_models() -> None:
    """Listing imports no model (and not torch), so it runs on its own, quickly."""
    result = finish(start("list-models"))
    assert result.returncode == 0, result.stderr
    listed = dict(line.split() for line in result.stdout.splitlines())
    assert set(ARCHITECTURES) <= set(listed)
    assert listed[LLAMA] == "engine_ref.model_executor.models.llama:LlamaForCausalLM"
    assert json.loads(finish(start("list-models", "--json")).stdout) == listed


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("missing dir", "is not a directory; pass a Hugging Face layout directory"),
        ("tp 3", "tensor_parallel_size=3 does not divide num_attention_heads=4 or intermediate_size=128 or "
                 "num_key_value_heads=2 (and is not a multiple of it) of LlamaForCausalLM; use one of [1, 2, 4]."),
    ],
)
def test_errors_exit_2_with_one_line_and_no_traceback(run: Run, name: str, message: str) -> None:
    result = run(name)
    assert result.returncode == 2
    assert result.stdout == ""
    assert "Traceback" not in result.stderr
    assert result.stderr.count("\n") == 1, result.stderr
    assert result.stderr.startswith("engine-ref: error: ")
    assert message in result.stderr


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--device-memory", "512KiB", "--max-model-len", "64", "--max-num-batched-tokens", "64"],
         "No memory is left for the KV cache on rank 0"),
        (["--device-memory", "8 gigs"], "device_memory='8 gigs' is not a size"),
        (["--max-model-len", "4096"], "max_model_len=4096 exceeds max_position_embeddings=512"),
    ],
    ids=["memory-too-small", "bad-device-memory", "max-model-len-too-long"],
)
def test_main_reports_engine_errors_in_one_line(extra: list[str], message: str, llama: Path,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["startup", str(llama), *extra]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith("engine-ref: error: ") and captured.err.count("\n") == 1, captured.err
    assert message in captured.err


def test_usage_errors_exit_2() -> None:
    result = finish(start("startup", LLAMA, "--tensor-parallel-size", "three"))
    assert result.returncode == 2
    assert "invalid int value: 'three'" in result.stderr and "Traceback" not in result.stderr


def test_a_temp_dir_too_long_for_the_warm_parents_socket_is_named(llama: Path) -> None:
    """multiprocessing's forkserver binds a Unix socket under TMPDIR (at most 108 bytes of path)."""
    root = Path(tempfile.mkdtemp(prefix="er-cli-"))
    long_tmp = root / ("t" * 100)
    long_tmp.mkdir()
    try:
        process = subprocess.run(
            [sys.executable, "-m", "engine_ref.entrypoints.cli", "startup", str(llama), "--tensor-parallel-size",
             "2", "--device-memory", "64MiB", "--max-model-len", "64", "--max-num-batched-tokens", "64"],
            capture_output=True, text=True, timeout=120, env={**os.environ, "TMPDIR": str(long_tmp)})
    finally:
        shutil.rmtree(root, ignore_errors=True)
    assert process.returncode == 2, process.stderr
    assert "Traceback" not in process.stderr
    assert f"TMPDIR={str(long_tmp)!r}" in process.stderr
    assert "Set TMPDIR to a shorter directory" in process.stderr


# -- malformed input: one line, exit 2, no traceback (issue 9) ---------------------------------------

HUGE = "9" * 30 + "TiB"
TRUNCATED_ON_TP2 = "truncated checkpoint at TP=2"


def _model_dir(root: Path, llama: Path, name: str, config: bytes | None = None,
               edit: Callable[[dict], None] | None = None) -> str:
    """A copy of the tiny Llama under ``root/name`` with config.json replaced or edited."""
    model = Path(shutil.copytree(llama, root / name))
    if config is not None:
        (model / "config.json").write_bytes(config)
    if edit is not None:
        data = json.loads((model / "config.json").read_text())
        edit(data)
        (model / "config.json").write_text(json.dumps(data))
    return str(model)


@pytest.fixture(scope="module")
def malformed(llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Run]:
    """``malformed(name)``: the finished process of one malformed-input command of MALFORMED, all started at once."""
    from safetensors.torch import load_file, save_file

    from engine_ref.model_executor.models.registry import ModelRegistry

    root = tmp_path_factory.mktemp("malformed")
    ModelRegistry.inspect_model_cls(LLAMA)  # the shared ModelInfo cache, filled before the children look
    float64 = Path(_model_dir(root, llama, "float64"))
    tensors = load_file(float64 / "model.safetensors")
    tensors["model.norm.weight"] = tensors["model.norm.weight"].double()
    save_file(tensors, float64 / "model.safetensors")
    truncated = Path(_model_dir(root, llama, "truncated"))
    raw = (truncated / "model.safetensors").read_bytes()
    (truncated / "model.safetensors").write_bytes(raw[: len(raw) // 2])
    small = ["--max-model-len", "64", "--max-num-batched-tokens", "64"]
    commands: dict[str, tuple[list[str], dict[str, str] | None]] = {
        "config.json is a JSON list": (["startup", _model_dir(root, llama, "list", b'["LlamaForCausalLM"]')], None),
        "config.json is binary": (["estimate", _model_dir(root, llama, "binary", bytes(range(256))),
                                   "--device-memory", "8GiB"], None),
        "max_position_embeddings=1e12 (estimate)": (
            ["estimate", _model_dir(root, llama, "1e12", edit=lambda d: d.update(max_position_embeddings=10**12)),
             "--device-memory", "80GiB"], None),
        "max_position_embeddings=2**24 (startup)": (
            ["startup", _model_dir(root, llama, "2**24", edit=lambda d: d.update(max_position_embeddings=2**24))],
            None),
        "--device-memory 999...TiB (startup)": (["startup", str(llama), "--device-memory", HUGE, *small], None),
        "--device-memory 999...TiB (estimate)": (["estimate", str(llama), "--device-memory", HUGE], None),
        "--device-memory 1PiB on CPU": (["startup", str(llama), "--device-memory", "1PiB", *small], None),
        "--device-memory -1GiB": (["startup", str(llama), "--device-memory", "-1GiB", *small], None),
        "--max-model-len 10**13": (["startup", str(llama), "--max-model-len", str(10**13)], None),
        "ENGINE_REF_READY_TIMEOUT_S=abc": (["startup", str(llama), *small, "--device-memory", "64MiB"],
                                           {"ENGINE_REF_READY_TIMEOUT_S": "abc"}),
        "float64 tensor": (["startup", str(float64), *small, "--device-memory", "64MiB"], None),
        TRUNCATED_ON_TP2: (["startup", str(truncated), "-tp", "2", *small, "--device-memory", "64MiB"], None),
        "verbose": (["startup", str(truncated), "-tp", "2", *small, "--device-memory", "64MiB", "--verbose"], None),
    }
    processes = {name: start(*args, env=env) for name, (args, env) in commands.items() if name not in IN_PROCESS}
    in_process = {name: run_main(*commands[name]) for name in IN_PROCESS}  # while the processes run
    yield lambda name: in_process[name] if name in in_process else finish(processes[name])
    for process in processes.values():
        if process.poll() is None:
            process.kill()
            process.communicate()


def run_main(args: list[str], env: dict[str, str] | None) -> subprocess.CompletedProcess[str]:
    """``main(args)`` in this process with ``env`` set, as the finished process ``engine-ref ARGS`` would be."""
    out, err = io.StringIO(), io.StringIO()
    with pytest.MonkeyPatch.context() as patch, contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        for name, value in (env or {}).items():
            patch.setenv(name, value)
        returncode = main(args)
    return subprocess.CompletedProcess(["engine-ref", *args], returncode, out.getvalue(), err.getvalue())


# The malformed inputs that fail before any engine process starts: main(argv) in this process, the same code path
# without an interpreter each; the others (a tensor read by the loader, a worker's error) run as real processes.
IN_PROCESS = ("config.json is a JSON list", "config.json is binary", "max_position_embeddings=1e12 (estimate)",
              "max_position_embeddings=2**24 (startup)", "--device-memory 999...TiB (startup)",
              "--device-memory 999...TiB (estimate)", "--device-memory 1PiB on CPU", "--device-memory -1GiB",
              "--max-model-len 10**13", "ENGINE_REF_READY_TIMEOUT_S=abc")

MALFORMED = {
    # name: what the one line says (after "engine-ref: error: ")
    "config.json is a JSON list": "/list/config.json holds a JSON list, not an object",
    "config.json is binary": "/binary/config.json is not valid JSON for a config.json (not UTF-8 text",
    "max_position_embeddings=1e12 (estimate)":
        "/1e12/config.json: max_position_embeddings=1000000000000 is larger than engine_ref supports (at most "
        "16777216)",
    "max_position_embeddings=2**24 (startup)":
        "max_num_batched_tokens=16777216 (the profile run's batch) x hidden_size=64 needs 4.00 GiB per rank, more "
        "than the 0.9 x 4.00 GiB of device memory it may use",
    "--device-memory 999...TiB (startup)": f"device_memory={HUGE!r} is larger than any device",
    "--device-memory 999...TiB (estimate)": f"device_memory={HUGE!r} is larger than any device",
    "--device-memory 1PiB on CPU": "device_memory='1PiB' (1048576.00 GiB) exceeds this host's memory",
    "--device-memory -1GiB": "device_memory='-1GiB' must be larger than zero; write a size such as '8GiB'.",
    "--max-model-len 10**13": f"max_model_len={10**13} is larger than engine_ref supports (at most 16777216)",
    "ENGINE_REF_READY_TIMEOUT_S=abc": "ENGINE_REF_READY_TIMEOUT_S='abc' is not a number of seconds",
    "float64 tensor": "tensor 'model.norm.weight' in ",
    TRUNCATED_ON_TP2: "failed in load_model: engine_ref.errors.WeightLoadError: ",
}


@pytest.mark.parametrize("name", list(MALFORMED))
def test_malformed_input_gives_one_line_exit_2_and_no_traceback(name: str, malformed: Run) -> None:
    result = malformed(name)
    assert result.returncode == 2, result.stderr
    assert result.stdout == ""
    assert "Traceback" not in result.stderr
    assert result.stderr.startswith("engine-ref: error: ") and result.stderr.count("\n") == 1, result.stderr
    assert MALFORMED[name] in result.stderr, result.stderr


def test_a_workers_traceback_is_behind_verbose(malformed: Run) -> None:
    """At TP=2 the worker's error carries its traceback: the first line says what, --verbose shows the rest."""
    line = malformed(TRUNCATED_ON_TP2).stderr
    assert re.match(r"^engine-ref: error: Worker rank \d \(pid \d+\) failed in load_model: "
                    r"engine_ref\.errors\.WeightLoadError: .*/truncated/model\.safetensors is not a readable "
                    r"safetensors file .* \(--verbose prints the rest of this error\)$", line), line
    verbose = malformed("verbose")
    assert verbose.returncode == 2
    first, _, rest = verbose.stderr.partition("\n")
    def what(text: str) -> str:  # the line without which rank failed first, and its pid
        return re.sub(r"^engine-ref: error: Worker rank \d \(pid \d+\)", "", text)

    assert what(first) == what(line.removesuffix(" (--verbose prints the rest of this error)\n")), verbose.stderr
    assert re.search(r"^Traceback of rank \d:$", rest, re.MULTILINE) and "worker.load_model()" in rest, rest
