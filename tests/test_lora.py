"""LoRA: engine_ref's ...WithLoRA layers give transformers + PEFT's output, shard under TP, fail clearly.

PEFT is the reference no one here wrote: the same tiny checkpoint (float32) with the same
PEFT-format adapter (written by ``make_lora``, read by ``PeftModel.from_pretrained``) gives the
same logits and greedy tokens. The models are driven directly (built, loaded, then wrapped by the
LoRAModelManager), as the worker will after ``load_model``.
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

LLAMA = "LlamaForCausalLM"
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
