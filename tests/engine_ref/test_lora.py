"""LoRA: engine_ref's ...WithLoRA layers give transformers + PEFT's output, shard under TP, fail clearly.

PEFT is the reference no one here wrote: the same tiny checkpoint (float32) with the same
PEFT-format adapter (written by ``make_lora``, read by ``PeftModel.from_pretrained``) gives the
same logits and greedy tokens. The first half drives the models directly (built, loaded, then
wrapped by the LoRAModelManager, as the worker does after ``load_model``); the second starts the
engine with ``enable_lora=True`` (TP=1 in process, TP=2 on gloo ranks), its memory estimate, the
scheduler's adapter cap and the CLI.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine_ref.errors import ConfigError, InputError, WeightLoadError
from engine_ref.lora.checkpoint import make_lora
from engine_ref.lora.config import LoRAConfig
from engine_ref.lora.models import LoRAModelManager
from engine_ref.lora.peft_helper import ADAPTER_CONFIG, ADAPTER_WEIGHTS
from engine_ref.lora.request import LoRARequest
from tests.helpers import LLAMA

LORA_ARCHITECTURES = [LLAMA, "Qwen2ForCausalLM", "MixtralForCausalLM", "Qwen3MoeForCausalLM"]
PROMPTS = [[1, 5, 9, 13, 17], [1, 20, 30, 40, 50, 60, 70]]
MAX_TOKENS = 6
ATOL = 1e-4


# -- driving engine_ref's model directly ------------------------------------------------------------

def load_model(checkpoint: Path) -> torch.nn.Module:
    """This rank's model of ``checkpoint``, loaded the way the worker loads it."""
    from engine_ref.engine.arg_utils import EngineArgs
    from engine_ref.model_executor.model_loader.loaders import get_model_loader

    config = EngineArgs(model=str(checkpoint)).create_engine_config(inspect_in_subprocess=False)
    return get_model_loader(config.load_config).load_model(config, torch.device("cpu"))


def lora_model(checkpoint: Path, **lora_config: Any) -> tuple[torch.nn.Module, LoRAModelManager]:
    model = load_model(checkpoint)
    config = LoRAConfig(**{"max_lora_rank": 8, **lora_config})
    return model, LoRAModelManager(model, config, str(checkpoint), torch.float32)


@torch.inference_mode()
def our_logits(model: torch.nn.Module, manager: LoRAModelManager, prompts: list[list[int]],
               requests: list[LoRARequest | None]) -> list[torch.Tensor]:
    """Logits of every position of each prompt, all prompts in one batch, each with its own adapter."""
    from engine_ref.model_executor.forward_context import AttentionMetadata, set_forward_context

    lens = [len(p) for p in prompts]
    starts = [sum(lens[:i]) for i in range(len(lens) + 1)]
    manager.set_active_adapters(requests, lens)
    positions = torch.cat([torch.arange(n) for n in lens])
    with set_forward_context(AttentionMetadata(query_start_loc=starts, seq_lens=lens)):
        hidden_states = model(torch.tensor([t for p in prompts for t in p]), positions)
    logits = model.compute_logits(hidden_states)
    return [logits[starts[i]:starts[i + 1]] for i in range(len(prompts))]


def our_greedy(model: torch.nn.Module, manager: LoRAModelManager, prompt: list[int],
               request: LoRARequest | None) -> list[int]:
    tokens = list(prompt)
    for _ in range(MAX_TOKENS):
        tokens.append(int(our_logits(model, manager, [tokens], [request])[0][-1].argmax()))
    return tokens[len(prompt):]


# -- the reference: transformers + PEFT ------------------------------------------------------------

def peft_model(checkpoint: Path, adapters: dict[str, Path]) -> Any:
    """transformers' model of ``checkpoint`` with each adapter loaded under its name (float32)."""
    import peft
    import transformers

    hf_model = transformers.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    (first, path), *rest = adapters.items()
    model = peft.PeftModel.from_pretrained(hf_model, str(path), adapter_name=first)
    for name, path in rest:
        model.load_adapter(str(path), adapter_name=name)
    return model.eval()


@torch.inference_mode()
def peft_logits(model: Any, prompt: list[int], adapter: str | None) -> torch.Tensor:
    if adapter is None:
        with model.disable_adapter():
            return model(torch.tensor([prompt])).logits[0]
    model.set_adapter(adapter)
    return model(torch.tensor([prompt])).logits[0]


@torch.inference_mode()
def peft_greedy(model: Any, prompt: list[int], adapter: str) -> list[int]:
    model.set_adapter(adapter)
    input_ids = torch.tensor([prompt])
    out = model.generate(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), do_sample=False,
                         max_new_tokens=MAX_TOKENS, min_new_tokens=MAX_TOKENS)
    return out[0, len(prompt):].tolist()


# -- fixtures --------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def adapter(tiny_checkpoint: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory
            ) -> Callable[..., Path]:
    """``adapter(arch, seed=0, **make_lora_kwargs)``: a tiny PEFT adapter for arch's tiny checkpoint, cached."""
    made: dict[str, Path] = {}

    def get(architecture: str, seed: int = 0, **kwargs: Any) -> Path:
        key = f"{architecture}-{seed}-{sorted(kwargs.items())}"
        if key not in made:
            made[key] = make_lora(tiny_checkpoint(architecture), tmp_path_factory.mktemp("lora"), seed=seed, **kwargs)
        return made[key]

    return get


@pytest.fixture
def broken(adapter: Callable[..., Path], tmp_path: Path) -> Callable[[str], Path]:
    """``broken(arch)``: a private copy of arch's adapter, for a test to corrupt."""
    def copy(architecture: str) -> Path:
        return Path(shutil.copytree(adapter(architecture), tmp_path / "adapter"))

    return copy


def request(path: Path, lora_int_id: int = 1) -> LoRARequest:
    return LoRARequest(f"adapter-{lora_int_id}", lora_int_id, str(path))


# -- equal to transformers + PEFT ------------------------------------------------------------------

@pytest.mark.parametrize("arch", LORA_ARCHITECTURES)
def test_adapter_output_equals_peft(arch: str, tiny_checkpoint: Callable[..., Path],
                                    adapter: Callable[..., Path]) -> None:
    """One batch: the first prompt with the adapter, the second without; tokens and logits as PEFT's."""
    checkpoint, path = tiny_checkpoint(arch), adapter(arch)
    reference = peft_model(checkpoint, {"a": path})
    from peft import get_peft_model_state_dict

    # PEFT read every tensor of our file, unchanged: it is PEFT's format.
    written, read = load_file(str(path / ADAPTER_WEIGHTS)), get_peft_model_state_dict(reference, adapter_name="a")
    assert written.keys() == read.keys()
    assert all(torch.equal(written[k], read[k]) for k in written)

    model, manager = lora_model(checkpoint)
    with_lora, without = our_logits(model, manager, PROMPTS, [request(path), None])
    torch.testing.assert_close(with_lora, peft_logits(reference, PROMPTS[0], "a"), atol=ATOL, rtol=0)
    torch.testing.assert_close(without, peft_logits(reference, PROMPTS[1], None), atol=ATOL, rtol=0)
    base = our_logits(model, manager, PROMPTS[:1], [None])[0]
    assert (with_lora - base).abs().max() > 0.5, "the adapter should change the logits"

    tokens = our_greedy(model, manager, PROMPTS[0], request(path))
    assert tokens == peft_greedy(reference, PROMPTS[0], "a")
    assert tokens != our_greedy(model, manager, PROMPTS[0], None), "the adapter should change the tokens"


def test_two_adapters_in_one_batch_each_give_their_own_output(tiny_checkpoint: Callable[..., Path],
                                                              adapter: Callable[..., Path]) -> None:
    checkpoint = tiny_checkpoint(LLAMA)
    first, second = adapter(LLAMA, seed=1), adapter(LLAMA, seed=2, target_modules=["q_proj", "v_proj", "down_proj"])
    reference = peft_model(checkpoint, {"first": first, "second": second})
    model, manager = lora_model(checkpoint, max_loras=2)
    prompts = [PROMPTS[0], PROMPTS[0], PROMPTS[1], PROMPTS[1]]
    outputs = our_logits(model, manager, prompts, [request(first, 1), request(second, 2), request(second, 2),
                                                   request(first, 1)])
    for prompt, name, ours in zip(prompts, ["first", "second", "second", "first"], outputs, strict=True):
        torch.testing.assert_close(ours, peft_logits(reference, prompt, name), atol=ATOL, rtol=0)
    assert (outputs[0] - outputs[1]).abs().max() > 0.5, "two adapters should give two outputs"


def test_rslora_scaling_equals_peft(tiny_checkpoint: Callable[..., Path], broken: Callable[[str], Path]) -> None:
    path = broken(LLAMA)
    config = json.loads((path / ADAPTER_CONFIG).read_text())
    (path / ADAPTER_CONFIG).write_text(json.dumps({**config, "use_rslora": True}))
    checkpoint = tiny_checkpoint(LLAMA)
    model, manager = lora_model(checkpoint)
    ours = our_logits(model, manager, PROMPTS[:1], [request(path)])[0]
    torch.testing.assert_close(ours, peft_logits(peft_model(checkpoint, {"a": path}), PROMPTS[0], "a"),
                               atol=ATOL, rtol=0)


def test_slots_and_cpu_cache_evict_the_least_recently_used(tiny_checkpoint: Callable[..., Path],
                                                           adapter: Callable[..., Path]) -> None:
    """One slot, two adapters on the CPU, three adapters in turn: each output stays its own."""
    checkpoint = tiny_checkpoint(LLAMA)
    paths = [adapter(LLAMA, seed=s) for s in (1, 2, 3)]
    single = {}  # each adapter alone in a fresh manager: no eviction there
    for i, path in enumerate(paths, start=1):
        fresh_model, fresh_manager = lora_model(checkpoint)
        single[i] = our_logits(fresh_model, fresh_manager, PROMPTS[:1], [request(path, i)])[0]
    assert (single[1] - single[2]).abs().max() > 0.5
    model, manager = lora_model(checkpoint, max_loras=1, max_cpu_loras=2)
    file_bytes = [sum(t.numel() * t.element_size() for t in load_file(str(p / ADAPTER_WEIGHTS)).values())
                  for p in paths]
    for step, i in enumerate([1, 2, 3, 1, 3]):
        ours = our_logits(model, manager, PROMPTS[:1], [request(paths[i - 1], i)])[0]
        torch.testing.assert_close(ours, single[i], atol=1e-6, rtol=0, msg=f"step {step}: adapter {i}")
    # Adapter 1 left the CPU cache when adapter 3 came and was read again; adapter 3 was still cached.
    assert manager.stats.bytes_read == sum(file_bytes) + file_bytes[0]


def test_make_lora_is_deterministic(tiny_checkpoint: Callable[..., Path], tmp_path: Path) -> None:
    checkpoint = tiny_checkpoint(LLAMA)
    files = [make_lora(checkpoint, tmp_path / name, seed=seed) / ADAPTER_WEIGHTS
             for name, seed in (("a", 0), ("b", 0), ("c", 1))]
    assert files[0].read_bytes() == files[1].read_bytes()
    assert files[0].read_bytes() != files[2].read_bytes()
    assert all(t.abs().max() > 0 for t in load_file(str(files[0])).values()), "B must not be PEFT's zeros"


# -- tensor parallelism ----------------------------------------------------------------------------

def rank_logits(rank: int, world_size: int, checkpoint: str, lora_path: str) -> tuple[list[torch.Tensor], int, int]:
    """On one rank: logits of PROMPTS (the first with the adapter), adapter bytes read, slot bytes."""
    model, manager = lora_model(Path(checkpoint))
    logits = our_logits(model, manager, PROMPTS, [request(Path(lora_path)), None])
    return logits, manager.stats.bytes_read, manager.lora_slot_bytes


def meta_slot_bytes(checkpoint: Path, rank: int, world_size: int) -> int:
    """Rank ``rank``'s slot bytes of a TP=world_size engine, built on the meta device (no processes)."""
    from engine_ref.distributed.parallel_state import tensor_parallel_state
    from engine_ref.engine.arg_utils import EngineArgs
    from engine_ref.model_executor.model_loader.loaders import initialize_model

    config = EngineArgs(model=str(checkpoint)).create_engine_config(inspect_in_subprocess=False)
    with tensor_parallel_state(rank, world_size):
        model = initialize_model(config, torch.device("meta"))
        return LoRAModelManager(model, LoRAConfig(max_lora_rank=8), str(checkpoint), torch.float32).lora_slot_bytes


@pytest.mark.parametrize(("arch", "tp"), [(LLAMA, 2), (LLAMA, 4), ("Qwen2ForCausalLM", 2),
                                          ("Qwen3MoeForCausalLM", 2)])
def test_tensor_parallel_equals_tp1_with_adapter(arch: str, tp: int, tiny_checkpoint: Callable[..., Path],
                                                 adapter: Callable[..., Path],
                                                 multirank: Callable[..., list[Any]]) -> None:
    """Real gloo ranks (TP=4 replicates Llama's 2 KV heads); each rank reads only its slices of the adapter."""
    checkpoint, path = tiny_checkpoint(arch), adapter(arch)
    expected, total_read, _ = rank_logits(0, 1, str(checkpoint), str(path))
    ranks = multirank(rank_logits, str(checkpoint), str(path), world_size=tp)
    for rank, (logits, read, slot_bytes) in enumerate(ranks):
        for ours, theirs in zip(logits, expected, strict=True):
            torch.testing.assert_close(ours, theirs, atol=ATOL, rtol=0, msg=f"rank {rank} of TP={tp}")
        assert read < total_read, f"rank {rank} read {read} of the adapter's {total_read} bytes: more than its share"
        assert slot_bytes == meta_slot_bytes(checkpoint, rank, tp), "the meta-device estimate must equal the rank"
    assert sum(read for _, read, _ in ranks) >= total_read


def test_slot_bytes_are_the_preallocated_slots(tiny_checkpoint: Callable[..., Path]) -> None:
    """Llama's slots by hand: per layer A and B of qkv, o, gate_up and down, for every slot."""
    checkpoint = tiny_checkpoint(LLAMA)
    c = json.loads((checkpoint / "config.json").read_text())
    hidden, inter, layers, r = c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"], 8
    qkv = hidden + 2 * c["num_key_value_heads"] * hidden // c["num_attention_heads"]
    per_slot = layers * r * (3 * hidden + qkv + hidden + hidden + 2 * hidden + 2 * inter + inter + hidden)
    for lora_dtype, itemsize in (("auto", 4), ("float16", 2)):
        _, manager = lora_model(checkpoint, max_loras=3, lora_dtype=lora_dtype)
        assert manager.lora_slot_bytes == 3 * per_slot * itemsize


# -- clear errors ----------------------------------------------------------------------------------

@pytest.mark.parametrize(("kwargs", "message"), [
    ({"max_loras": 0}, r"max_loras=0 must be an integer of at least 1 .*--max-loras 1"),
    ({"max_lora_rank": -4}, r"max_lora_rank=-4 must be an integer of at least 1 .*--max-lora-rank 1"),
    ({"max_loras": 2, "max_cpu_loras": 1}, r"max_cpu_loras=1 is smaller than max_loras=2.*at least 2"),
    ({"lora_dtype": "int8"}, r"lora_dtype='int8' is not supported; use auto"),
])
def test_bad_lora_config(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        LoRAConfig(**kwargs)


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"lora_name": "a", "lora_int_id": 0}, r"lora_int_id=0; give each adapter its own integer id of 1 or more"),
    ({"lora_name": "", "lora_int_id": 1}, r"empty lora_name"),
])
def test_bad_lora_request(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(InputError, match=message):
        LoRARequest(lora_path="/adapter", **kwargs)


def edit_config(path: Path, **changes: Any) -> Path:
    config = json.loads((path / ADAPTER_CONFIG).read_text())
    (path / ADAPTER_CONFIG).write_text(json.dumps({**config, **changes}))
    return path


def edit_tensors(path: Path, edit: Callable[[dict[str, torch.Tensor]], None]) -> Path:
    tensors = load_file(str(path / ADAPTER_WEIGHTS))
    edit(tensors)
    save_file(tensors, str(path / ADAPTER_WEIGHTS))
    return path


Q_PROJ_0 = "base_model.model.model.layers.0.self_attn.q_proj"


def truncate(path: Path) -> Path:
    weights = path / ADAPTER_WEIGHTS
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    return path


def bin_instead(path: Path) -> Path:
    (path / ADAPTER_WEIGHTS).rename(path / "adapter_model.bin")
    return path


BAD_ADAPTERS: dict[str, tuple[Callable[[Path], Path], type[Exception], str]] = {
    "missing-dir": (lambda p: p / "nowhere", ConfigError, r"lora_path=.*nowhere' is not a directory"),
    "no-config": (lambda p: (p / ADAPTER_CONFIG).unlink() or p, ConfigError, r"has no adapter_config.json"),
    "bad-json": (lambda p: (p / ADAPTER_CONFIG).write_text("{r: 4") and p, ConfigError, r"is not valid JSON"),
    "no-weights": (lambda p: (p / ADAPTER_WEIGHTS).unlink() or p, WeightLoadError,
                   r"has no adapter_model.safetensors; engine_ref reads adapters from safetensors"),
    "bin-weights": (bin_instead, WeightLoadError, r"holds adapter_model.bin: save it again with safe_serialization"),
    "truncated": (truncate, WeightLoadError, r"not a readable safetensors file .*truncated or corrupt"),
    "rank-above-max": (lambda p: edit_config(p, r=16), ConfigError,
                       r"has r=16, above max_lora_rank=8; start the engine with max_lora_rank=16"),
    "other-base-model": (lambda p: edit_config(p, base_model_name_or_path="meta-llama/Llama-2-7b-hf"), ConfigError,
                         r"trained for base model 'meta-llama/Llama-2-7b-hf'.*but the engine runs"),
    "unsupported-target": (lambda p: edit_config(p, target_modules=["q_proj", "lm_head"]), ConfigError,
                           r"targets \['lm_head'\], which this model cannot run LoRA on; it supports \['down_proj'"),
    "regex-target": (lambda p: edit_config(p, target_modules="all-linear"), ConfigError,
                     r"target_modules='all-linear'; engine_ref needs a list of module names"),
    "dora": (lambda p: edit_config(p, use_dora=True), ConfigError, r"sets use_dora=True \(DoRA"),
    "not-lora": (lambda p: edit_config(p, peft_type="IA3"), ConfigError, r"peft_type='IA3'; engine_ref runs LoRA"),
    "unsupported-tensor": (lambda p: edit_tensors(p, lambda t: t.update({
        "base_model.model.lm_head.lora_A.weight": torch.zeros(4, 64),
        "base_model.model.lm_head.lora_B.weight": torch.zeros(256, 4)})), ConfigError,
        r"holds LoRA weights for 'lm_head', a module this model cannot run LoRA on"),
    "missing-b": (lambda p: edit_tensors(p, lambda t: t.pop(f"{Q_PROJ_0}.lora_B.weight")), WeightLoadError,
                  r"has no lora_B for 'model.layers.0.self_attn.q_proj'"),
    "wrong-shape": (lambda p: edit_tensors(p, lambda t: t.update({f"{Q_PROJ_0}.lora_A.weight": torch.zeros(4, 32)})),
                    WeightLoadError, r"has shape \[4, 32\], but model.layers.0.self_attn.q_proj of this model "
                                     r"with r=4 needs \[4, 64\]"),
    "not-peft-name": (lambda p: edit_tensors(p, lambda t: t.update({"lora.q.weight": torch.zeros(1)})),
                      WeightLoadError, r"unexpected tensor 'lora.q.weight'.*PEFT names LoRA tensors"),
}


@pytest.mark.parametrize("case", BAD_ADAPTERS)
def test_bad_adapter(case: str, tiny_checkpoint: Callable[..., Path], broken: Callable[[str], Path]) -> None:
    corrupt, error, message = BAD_ADAPTERS[case]
    path = corrupt(broken(LLAMA))
    model, manager = lora_model(tiny_checkpoint(LLAMA))
    with pytest.raises(error, match=message):
        our_logits(model, manager, PROMPTS[:1], [request(path)])


def test_adapter_for_another_architecture(tiny_checkpoint: Callable[..., Path], adapter: Callable[..., Path],
                                          tmp_path: Path) -> None:
    """Qwen2's adapter names Qwen2's checkpoint; renamed for Llama, its MLP shapes still do not fit."""
    path = adapter("Qwen2ForCausalLM", target_modules=["gate_proj"])
    model, manager = lora_model(tiny_checkpoint(LLAMA))
    with pytest.raises(ConfigError, match=r"trained for base model .*Qwen2ForCausalLM"):
        our_logits(model, manager, PROMPTS[:1], [request(path)])
    renamed = edit_config(Path(shutil.copytree(path, tmp_path / "renamed")),
                          base_model_name_or_path=str(tiny_checkpoint(LLAMA)))
    with pytest.raises(WeightLoadError, match=r"gate_proj of this model with r=4 needs \[128, 4\]"):
        our_logits(model, manager, PROMPTS[:1], [request(renamed)])


def test_too_many_adapters_in_one_batch(tiny_checkpoint: Callable[..., Path], adapter: Callable[..., Path]) -> None:
    model, manager = lora_model(tiny_checkpoint(LLAMA), max_loras=1)
    with pytest.raises(InputError, match=r"this batch uses 2 adapters but max_loras=1; raise max_loras to 2"):
        our_logits(model, manager, PROMPTS, [request(adapter(LLAMA, seed=1), 1), request(adapter(LLAMA, seed=2), 2)])


def test_one_id_for_two_adapters(tiny_checkpoint: Callable[..., Path], adapter: Callable[..., Path]) -> None:
    model, manager = lora_model(tiny_checkpoint(LLAMA))
    our_logits(model, manager, PROMPTS[:1], [request(adapter(LLAMA, seed=1), 7)])
    with pytest.raises(InputError, match=r"lora_int_id=7 .* is already the id of the adapter at"):
        our_logits(model, manager, PROMPTS[:1], [request(adapter(LLAMA, seed=2), 7)])


# -- the engine: LLM(..., enable_lora=True) --------------------------------------------------------

ENGINE: dict[str, Any] = {"device_memory": "512MiB", "max_model_len": 64, "max_num_batched_tokens": 64}
ENGINE_ARCHITECTURES = [LLAMA, "Qwen2ForCausalLM", "Qwen3MoeForCausalLM"]


def lora_llm(checkpoint: Path, tp: int = 1, **kwargs: Any) -> Any:
    from engine_ref.entrypoints.llm import LLM

    return LLM(str(checkpoint), tensor_parallel_size=tp, enable_lora=True, max_lora_rank=8,
               **{**ENGINE, **kwargs})


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("arch", ENGINE_ARCHITECTURES)
def test_engine_greedy_tokens_equal_peft(arch: str, tp: int, tiny_checkpoint: Callable[..., Path],
                                         adapter: Callable[..., Path]) -> None:
    """One generate call: the first prompt with the adapter, the second without; each as transformers + PEFT."""
    checkpoint, path = tiny_checkpoint(arch), adapter(arch)
    reference = peft_model(checkpoint, {"a": path})
    with lora_llm(checkpoint, tp) as llm:
        with_lora, without = llm.generate(PROMPTS, max_tokens=MAX_TOKENS, ignore_eos=True,
                                          lora_request=[request(path), None])
        base = llm.generate(PROMPTS[:1], max_tokens=MAX_TOKENS, ignore_eos=True)[0]
        report = llm.startup_report
    assert with_lora == peft_greedy(reference, PROMPTS[0], "a")
    with reference.disable_adapter():
        input_ids = torch.tensor([PROMPTS[1]])
        expected = reference.generate(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), do_sample=False,
                                      max_new_tokens=MAX_TOKENS, min_new_tokens=MAX_TOKENS)[0, len(PROMPTS[1]):]
    assert without == expected.tolist()
    assert with_lora != base, "the adapter should change the tokens"
    assert [w.memory.lora for w in report.workers] == [meta_slot_bytes(checkpoint, rank, tp) for rank in range(tp)]


def test_two_adapters_in_one_engine_each_give_their_own_output(tiny_checkpoint: Callable[..., Path],
                                                                adapter: Callable[..., Path]) -> None:
    """Two adapters in one batch (max_loras=2), and the same requests with one slot (max_loras=1): the scheduler
    runs the second adapter's requests after the first's, and every prompt still gets its own adapter's tokens."""
    checkpoint = tiny_checkpoint(LLAMA)
    first, second = adapter(LLAMA, seed=1), adapter(LLAMA, seed=2, target_modules=["q_proj", "v_proj", "down_proj"])
    reference = peft_model(checkpoint, {"first": first, "second": second})
    prompts = [PROMPTS[0], PROMPTS[0], PROMPTS[1], PROMPTS[1]]
    names = ["first", "second", "second", "first"]
    requests = [request(first, 1), request(second, 2), request(second, 2), request(first, 1)]
    expected = [peft_greedy(reference, prompt, name) for prompt, name in zip(prompts, names, strict=True)]
    assert expected[0] != expected[1], "two adapters should give two outputs"
    for max_loras in (2, 1):
        with lora_llm(checkpoint, max_loras=max_loras) as llm:
            outputs = llm.generate(prompts, max_tokens=MAX_TOKENS, ignore_eos=True, lora_request=requests)
        assert outputs == expected, f"max_loras={max_loras}"


def test_scheduler_runs_at_most_max_loras_adapters(tmp_path: Path) -> None:
    from engine_ref.engine.scheduler import Request, Scheduler
    from engine_ref.kv_cache.block_pool import BlockPool

    scheduler = Scheduler(BlockPool(64, 16), max_num_batched_tokens=256, max_num_seqs=8, max_model_len=64, max_loras=2)
    loras = [None, request(tmp_path, 1), request(tmp_path, 2), request(tmp_path, 1), request(tmp_path, 3), None]
    for i, lora in enumerate(loras):
        scheduler.add_request(Request(i, [1, 2, 3], 1, lora_request=lora))
    steps = []
    while scheduler.has_unfinished_requests():
        output = scheduler.schedule()
        steps.append([s.request_id for s in output.seqs])
        assert len({s.lora_request.lora_int_id for s in output.seqs if s.lora_request}) <= 2
        scheduler.update_from_output(output, [7] * len(output.seqs))
    assert steps == [[0, 1, 2, 3], [4, 5]], "adapter 3 waits until a slot's requests finish; FCFS after it"


@pytest.mark.parametrize("tp", [1, 2])
def test_estimate_equals_measurement_with_lora(tp: int, tiny_checkpoint: Callable[..., Path]) -> None:
    """The lora category is its own, exact on every rank; buffers stay the model's own."""
    from engine_ref.memory.compare import compare_with_report
    from engine_ref.memory.estimate import estimate_memory

    checkpoint = tiny_checkpoint(LLAMA)
    settings = {"device_memory": ENGINE["device_memory"], "max_model_len": ENGINE["max_model_len"],
                "max_num_batched_tokens": ENGINE["max_num_batched_tokens"], "tensor_parallel_size": tp}
    estimate = estimate_memory(checkpoint, enable_lora=True, max_lora_rank=8, **settings)
    with lora_llm(checkpoint, tp, max_loras=1) as llm:
        report = llm.startup_report
    comparison = compare_with_report(estimate, report)
    assert comparison.ok, comparison.describe()
    assert {d.category for d in comparison.differences} >= {"lora"}
    slots = [meta_slot_bytes(checkpoint, rank, tp) for rank in range(tp)]
    assert estimate.lora_bytes_per_rank == [w.memory.lora for w in report.workers] == slots
    assert all(s > 0 for s in slots)
    plain = estimate_memory(checkpoint, **settings)
    assert plain.lora_bytes_per_rank == [0] * tp
    assert estimate.buffer_bytes_per_rank == plain.buffer_bytes_per_rank == [w.memory.buffers for w in report.workers]
    assert sum(estimate.kv_cache_bytes_per_rank) < sum(plain.kv_cache_bytes_per_rank), "the slots leave less KV cache"
    assert "LoRA" in estimate.format_table() and "LoRA" in report.format_table()
    assert "LoRA" not in plain.format_table()


def test_lora_slots_that_do_not_fit(tiny_checkpoint: Callable[..., Path]) -> None:
    """The estimate names the lora category; the engine refuses to start, saying what to lower."""
    from engine_ref.entrypoints.llm import LLM
    from engine_ref.errors import KVCacheTooSmallError
    from engine_ref.memory.estimate import estimate_memory

    checkpoint = tiny_checkpoint(LLAMA)
    slots = {"enable_lora": True, "max_loras": 8, "max_lora_rank": 256}
    estimate = estimate_memory(checkpoint, device_memory="16MiB", max_model_len=64, max_num_batched_tokens=64,
                               **slots)
    weights = estimate.weight_bytes_per_rank[0] + estimate.buffer_bytes_per_rank[0]
    assert weights < estimate.budget_bytes < weights + estimate.lora_bytes_per_rank[0]
    assert (estimate.fits, estimate.overflow, estimate.max_model_len_estimate) == (False, "lora", 0)
    assert "max_loras=8 x max_lora_rank=256" in estimate.reason
    assert "lower max_loras or max_lora_rank" in estimate.reason
    with pytest.raises(KVCacheTooSmallError, match=r"No memory is left for the KV cache on rank 0: .*the LoRA adapter "
                                                   r"slots \([\d.]+ MiB\).*lower max_loras or max_lora_rank") as info:
        LLM(str(checkpoint), device_memory="16MiB", max_model_len=64, max_num_batched_tokens=64, **slots)
    assert info.value.shortfall.lora == estimate.lora_bytes_per_rank[0]
    from pytest_enginecheck.budget import describe_shortfall

    assert "LoRA slots" in describe_shortfall(info.value.shortfall, 16 * 2**20)


@pytest.mark.parametrize(("arch", "kwargs", "message"), [
    ("LlavaForConditionalGeneration", {"enable_lora": True},
     r"enable_lora=True, but LlavaForConditionalGeneration does not support LoRA .*SupportsLoRA.*without enable_lora"),
    (LLAMA, {"enable_lora": "yes"}, r"enable_lora='yes' must be True or False"),
    (LLAMA, {"enable_lora": True, "max_loras": 0}, r"max_loras=0 must be an integer of at least 1 .*--max-loras 1"),
    (LLAMA, {"enable_lora": True, "max_lora_rank": 0}, r"max_lora_rank=0 must be an integer of at least 1"),
    (LLAMA, {"enable_lora": True, "max_loras": 3, "max_cpu_loras": 2}, r"max_cpu_loras=2 is smaller than max_loras=3"),
    (LLAMA, {"enable_lora": True, "lora_dtype": "int4"}, r"lora_dtype='int4' is not supported"),
])
def test_bad_engine_args(arch: str, kwargs: dict[str, Any], message: str, tiny_checkpoint: Callable[..., Path]) -> None:
    from engine_ref.engine.arg_utils import EngineArgs

    with pytest.raises(ConfigError, match=message):
        EngineArgs(model=str(tiny_checkpoint(arch)), **kwargs).create_engine_config()


def test_model_info_reports_lora_support() -> None:
    """The registry's inspection (a subprocess) reads SupportsLoRA off each class."""
    from engine_ref.model_executor.models.registry import ModelRegistry

    assert {arch: ModelRegistry.inspect_model_cls(arch).supports_lora for arch in
            [*LORA_ARCHITECTURES, "LlavaForConditionalGeneration"]} == {
        **dict.fromkeys(LORA_ARCHITECTURES, True), "LlavaForConditionalGeneration": False}


def test_bad_lora_requests_in_generate(tiny_checkpoint: Callable[..., Path], adapter: Callable[..., Path],
                                       broken: Callable[[str], Path]) -> None:
    """Each refused before any prompt runs; the engine generates normally afterwards."""
    from engine_ref.entrypoints.llm import LLM

    checkpoint, good = tiny_checkpoint(LLAMA), adapter(LLAMA)
    with LLM(str(checkpoint), **ENGINE) as plain, \
            pytest.raises(InputError, match=r"started without LoRA; start it with LLM\(..., enable_lora=True\)"):
        plain.generate(PROMPTS, max_tokens=2, lora_request=request(good))
    big = edit_config(broken(LLAMA), r=16)
    with lora_llm(checkpoint) as llm:
        with pytest.raises(InputError, match=r"lora_request is a list of 1 for 2 prompts; pass one LoRARequest"):
            llm.generate(PROMPTS, max_tokens=2, lora_request=[request(good)])
        with pytest.raises(InputError, match=r"lora_request\[1\] is a str, not a LoRARequest"):
            llm.generate(PROMPTS, max_tokens=2, lora_request=[None, str(good)])
        with pytest.raises(ConfigError, match=r"has r=16, above max_lora_rank=8; start the engine with max_lora_rank="):
            llm.generate(PROMPTS, max_tokens=2, lora_request=[request(good, 1), request(big, 2)])
        assert not llm.engine.has_unfinished_requests()
        [tokens] = llm.generate(PROMPTS[:1], max_tokens=MAX_TOKENS, ignore_eos=True, lora_request=request(good))
        assert tokens == our_greedy(*lora_model(checkpoint), PROMPTS[0], request(good))


def test_bad_adapter_at_tp2_names_the_rank(tiny_checkpoint: Callable[..., Path], broken: Callable[[str], Path]) -> None:
    from engine_ref.errors import EngineRefError

    path = edit_config(broken(LLAMA), target_modules=["q_proj", "lm_head"])
    with lora_llm(tiny_checkpoint(LLAMA), 2) as llm:
        with pytest.raises(EngineRefError, match=r"add_lora failed on rank 0: [\w.]*ConfigError: adapter .* targets "
                                                  r"\['lm_head'\], which this model cannot run LoRA on"):
            llm.generate(PROMPTS, max_tokens=2, lora_request=request(path))
        assert len(llm.generate(PROMPTS, max_tokens=2)) == 2, "the engine still serves"


# -- the CLI ---------------------------------------------------------------------------------------

def test_cli_make_lora_startup_and_estimate(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                            tiny_checkpoint: Callable[..., Path]) -> None:
    from engine_ref.entrypoints.cli import LORA_BASE_DIR, build_parser, main
    from engine_ref.entrypoints.llm import LLM

    assert main(["make-lora", LLAMA, str(tmp_path / "a"), "--rank", "4", "--target-modules", "q_proj,down_proj"]) == 0
    base = tmp_path / "a" / LORA_BASE_DIR
    assert f"to {base}" in capsys.readouterr().out
    config = json.loads((tmp_path / "a" / ADAPTER_CONFIG).read_text())
    assert (config["r"], config["target_modules"], config["base_model_name_or_path"]) == (
        4, ["down_proj", "q_proj"], str(base))
    assert main(["make-lora", LLAMA, str(tmp_path / "b")]) == 0  # the same seed: the same files
    weights = (tmp_path / "b" / LORA_BASE_DIR / "model.safetensors").read_bytes()
    assert weights == (base / "model.safetensors").read_bytes()
    with LLM(str(base), enable_lora=True, max_lora_rank=4, **ENGINE) as llm:
        with_lora = llm.generate(PROMPTS, max_tokens=MAX_TOKENS, ignore_eos=True,
                                 lora_request=LoRARequest("cli", 1, str(tmp_path / "a")))
        assert with_lora != llm.generate(PROMPTS, max_tokens=MAX_TOKENS, ignore_eos=True)

    llama = tiny_checkpoint(LLAMA)
    assert main(["make-lora", LLAMA, str(tmp_path / "c"), "--model", str(llama), "--seed", "3"]) == 0
    assert json.loads((tmp_path / "c" / ADAPTER_CONFIG).read_text())["base_model_name_or_path"] == str(llama)
    assert not (tmp_path / "c" / LORA_BASE_DIR).exists()
    capsys.readouterr()
    assert main(["make-lora", "Qwen2ForCausalLM", str(tmp_path / "d"), "--model", str(llama)]) == 2
    assert "is a LlamaForCausalLM, not a Qwen2ForCausalLM" in capsys.readouterr().err
    assert main(["make-lora", LLAMA, str(tmp_path / "e"), "--model", str(llama), "--target-modules", "lm_head"]) == 2
    assert "target_modules ['lm_head'] are not modules LlamaForCausalLM runs LoRA on" in capsys.readouterr().err
    assert main(["make-lora", LLAMA, str(tmp_path / "f"), "--model", str(llama), "--rank", "0"]) == 2
    assert "r=0 must be an integer of at least 1" in capsys.readouterr().err

    small = ["--max-model-len", "64", "--max-num-batched-tokens", "64", "--device-memory", "512MiB"]
    assert main(["startup", str(llama), *small, "--enable-lora", "--max-loras", "2", "--max-lora-rank", "8",
                 "--json"]) == 0
    [worker] = json.loads(capsys.readouterr().out)["workers"]
    assert worker["memory"]["lora"] == 2 * meta_slot_bytes(llama, 0, 1)
    assert main(["estimate", str(llama), *small, "--enable-lora", "--max-loras", "2", "--max-lora-rank", "8",
                 "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["lora_bytes_per_rank"] == [worker["memory"]["lora"]]
    assert main(["startup", str(llama), *small, "--enable-lora", "--max-loras", "0"]) == 2
    assert "max_loras=0 must be an integer of at least 1" in capsys.readouterr().err
    helps = {p.dest: p.help for p in build_parser()._subparsers._group_actions[0].choices["startup"]._actions}
    assert all(helps[name] for name in ("enable_lora", "max_loras", "max_lora_rank"))
