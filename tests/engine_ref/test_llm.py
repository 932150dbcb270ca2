"""LLM, the offline entry point: input validation, lifecycle, determinism, batching, the startup report."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from engine_ref import LLM
from engine_ref.errors import EngineDeadError, InputError
from tests.helpers import LLAMA, SMALL_ENGINE

PROMPTS = [[1, 5, 9, 13, 17, 21], [7, 3], [200, 100, 50, 25]]


@pytest.fixture(scope="module")
def llm(llama: Path) -> Iterator[LLM]:
    """One engine shared by the tests that only generate or read its report."""
    with LLM(str(llama), **SMALL_ENGINE) as engine:
        yield engine


INVALID_INPUTS = {
    "empty-prompt": ([[1, 2], []], {}, "prompt 1 is empty; give at least one token id"),
    "token-id-equal-to-vocab-size": ([[1, 256, 3]], {}, r"prompt 0 holds token ids outside \[0, 256\): \[256\]"),
    "negative-token-id": ([[-1]], {}, r"outside \[0, 256\): \[-1\]"),
    "float-token-id": ([[1, 2.0]], {}, r"outside \[0, 256\): \[2.0\]"),
    "flat-list-instead-of-list-of-prompts": ([1, 2, 3], {}, "prompt 0 is a int, not a list of token ids"),
    "prompt-plus-max-tokens-over-max-model-len": (
        [[1] * 60], {"max_tokens": 5},
        "prompt 0 has 60 tokens; with max_tokens=5 it needs 65 positions, more than max_model_len=64"),
    "max-tokens-zero": ([[1, 2]], {"max_tokens": 0}, "max_tokens=0 must be a positive integer"),
    "max-tokens-negative": ([[1, 2]], {"max_tokens": -3}, "max_tokens=-3 must be a positive integer"),
    "images-per-prompt-mismatch": ([[1], [2]], {"images": [None]}, "1 images entries for 2 prompts"),
}


@pytest.mark.parametrize(("prompts", "kwargs", "message"), list(INVALID_INPUTS.values()), ids=list(INVALID_INPUTS))
def test_invalid_input_is_refused_and_nothing_is_queued(llm: LLM, prompts: list[Any], kwargs: dict[str, Any],
                                                        message: str) -> None:
    with pytest.raises(InputError, match=message):
        llm.generate(prompt_token_ids=prompts, **kwargs)
    assert not llm.engine.has_unfinished_requests()
    assert llm.engine.scheduler.block_pool.num_free_blocks == llm.engine.scheduler.block_pool.num_blocks


def test_a_prompt_exactly_at_max_model_len_is_served(llm: LLM) -> None:
    assert len(llm.generate(prompt_token_ids=[[1] * 60], max_tokens=4, ignore_eos=True)[0]) == 4


def test_unknown_argument_to_llm_is_a_type_error(llama: Path) -> None:
    with pytest.raises(TypeError, match=r"unknown argument\(s\) max_len, tp;.*max_model_len"):
        LLM(str(llama), max_len=64, tp=2)


def test_generate_is_deterministic(llm: LLM, llama: Path) -> None:
    first = llm.generate(prompt_token_ids=PROMPTS, max_tokens=6, ignore_eos=True)
    assert llm.generate(prompt_token_ids=PROMPTS, max_tokens=6, ignore_eos=True) == first
    with LLM(str(llama), **SMALL_ENGINE) as other:
        assert other.generate(prompt_token_ids=PROMPTS, max_tokens=6, ignore_eos=True) == first
    assert [len(tokens) for tokens in first] == [6, 6, 6]


def test_a_batch_equals_each_prompt_alone(llm: LLM) -> None:
    batch = llm.generate(prompt_token_ids=PROMPTS, max_tokens=6, ignore_eos=True)
    alone = [llm.generate(prompt_token_ids=[prompt], max_tokens=6, ignore_eos=True)[0] for prompt in PROMPTS]
    assert batch == alone
    assert len({tuple(tokens) for tokens in batch}) > 1  # the prompts really lead to different outputs


def test_generation_stops_at_eos_unless_ignored(llm: LLM, llama: Path, tmp_path: Path) -> None:
    """With config.json's eos_token_id set to a token the model emits, generation ends right after it."""
    tokens = llm.generate(prompt_token_ids=[PROMPTS[0]], max_tokens=8, ignore_eos=True)[0]
    k = next((i for i in range(1, len(tokens)) if tokens[i] not in tokens[:i]), None)
    assert k is not None, f"the tiny model repeats one token: {tokens}"
    model = Path(shutil.copytree(llama, tmp_path / "llama"))
    config = json.loads((model / "config.json").read_text())
    config["eos_token_id"] = tokens[k]
    (model / "config.json").write_text(json.dumps(config))
    with LLM(str(model), **SMALL_ENGINE) as eos_llm:
        assert eos_llm.generate(prompt_token_ids=[PROMPTS[0]], max_tokens=8)[0] == tokens[: k + 1]
        assert eos_llm.generate(prompt_token_ids=[PROMPTS[0]], max_tokens=8, ignore_eos=True)[0] == tokens


def test_startup_report(llm: LLM, llama: Path) -> None:
    report = llm.startup_report
    assert list(report.phases) == ["plugins", "config", "executor", "kv_cache", "ready"]
    assert all(seconds >= 0 for seconds in report.phases.values())
    assert (report.architecture, report.model, report.tensor_parallel_size, report.executor_backend) == (
        LLAMA, str(llama), 1, "uni")
    assert report.max_model_len == 64 and report.block_size == 16
    [worker] = report.workers
    assert worker.rank == 0 and worker.pid == os.getpid()  # the uni executor runs the rank in-process
    assert list(worker.phases) == ["init_device", "load_model", "profile_run", "initialize_cache"]
    memory = worker.memory
    assert memory.capacity == 64 * 1024**2
    model = llm.engine.executor.worker.model
    assert memory.weights == sum(t.numel() * t.element_size() for t in model.parameters())
    assert memory.buffers == sum(t.numel() * t.element_size() for t in model.buffers()) > 0
    assert memory.activation_peak > 0
    assert memory.kv_cache > 0 and memory.kv_cache % report.num_gpu_blocks == 0
    assert memory.total == memory.weights + memory.buffers + memory.activation_peak + memory.kv_cache <= memory.capacity
    data = json.loads(report.to_json())
    assert set(data["workers"][0]["memory"]) == {"capacity", "weights", "buffers", "lora", "activation_peak",
                                                 "kv_cache", "total"}
    assert memory.lora == 0  # no enable_lora
    table = report.format_table()
    assert all(phase in table for phase in report.phases)
    assert str(os.getpid()) in table and "64.00 MiB" in table


def test_context_manager_shuts_down(llama: Path) -> None:
    with LLM(str(llama), **SMALL_ENGINE) as llm:
        executor = llm.engine.executor
        assert not executor.is_shutdown
    assert executor.is_shutdown
    assert executor.worker.model is None  # the weights are released
    llm.shutdown()  # idempotent
    with pytest.raises(EngineDeadError, match="shut down; create a new LLM"):
        llm.generate(prompt_token_ids=[[1]])


def test_context_manager_shuts_down_on_error(llama: Path) -> None:
    with pytest.raises(InputError), LLM(str(llama), **SMALL_ENGINE) as llm:
        llm.generate(prompt_token_ids=[[]])
    assert llm.engine.executor.is_shutdown


def test_float16_engine_generates(tiny_checkpoint: Callable[..., Path]) -> None:
    """dtype follows config.json: a float16 checkpoint runs in float16."""
    model = tiny_checkpoint(LLAMA, dtype="float16")
    with LLM(str(model), **SMALL_ENGINE) as llm:
        assert llm.engine.config.model_config.torch_dtype == torch.float16
        assert next(llm.engine.executor.worker.model.parameters()).dtype == torch.float16
        tokens = llm.generate(prompt_token_ids=PROMPTS, max_tokens=4, ignore_eos=True)
    assert [len(t) for t in tokens] == [4, 4, 4]
