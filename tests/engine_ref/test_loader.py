"""Weight loading: each broken checkpoint fails with its own WeightLoadError; good ones load exactly.

Checkpoints are real files written by ``make_checkpoint`` (through the session's ``tiny_checkpoint``),
copied before they are damaged. Engines start through ``LLM`` with the in-process ``uni`` executor,
so a loader error surfaces as itself.
"""

from __future__ import annotations

import shutil
import struct
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from engine_ref import LLM
from engine_ref.config import EngineConfig
from engine_ref.distributed.parallel_state import tensor_parallel_state
from engine_ref.engine.arg_utils import EngineArgs
from engine_ref.errors import WeightLoadError
from engine_ref.model_executor.model_loader.checkpoint import make_checkpoint
from engine_ref.model_executor.model_loader.loaders import (
    DefaultModelLoader,
    DummyModelLoader,
    get_model_loader,
    initialize_model,
)
from engine_ref.model_executor.model_loader.weight_utils import CheckpointTensor, LoadStats
from engine_ref.model_executor.models.llama import LlamaForCausalLM
from tests.helpers import LLAMA, SMALL_ENGINE

PROMPTS = [[1, 5, 9, 13, 17], [7, 3]]
MAX_TOKENS = 6


def generate(model: Path, **kwargs: Any) -> list[list[int]]:
    with LLM(str(model), **SMALL_ENGINE, **kwargs) as llm:
        return llm.generate(prompt_token_ids=PROMPTS, max_tokens=MAX_TOKENS, ignore_eos=True)


def start(model: Path, **kwargs: Any) -> None:
    with LLM(str(model), **SMALL_ENGINE, **kwargs):
        pass


def data_bytes(safetensors_file: Path) -> int:
    """Bytes of tensor data in a safetensors file: everything after the 8-byte length and the header."""
    raw = safetensors_file.read_bytes()
    (header_len,) = struct.unpack("<Q", raw[:8])
    return len(raw) - 8 - header_len


@pytest.fixture
def llama_copy(llama: Path, tmp_path: Path) -> Path:
    """A private copy of the tiny Llama checkpoint, free to damage."""
    return Path(shutil.copytree(llama, tmp_path / "llama"))


@pytest.fixture(scope="module")
def reference_tokens(tiny_checkpoint: Callable[..., Path]) -> list[list[int]]:
    """Greedy tokens of the single-file safetensors checkpoint."""
    return generate(tiny_checkpoint(LLAMA))


def edit_tensors(model: Path, edit: Callable[[dict[str, torch.Tensor]], None]) -> None:
    path = model / "model.safetensors"
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path)


# -- broken checkpoints ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name",
    ["model.layers.1.mlp.down_proj.weight", "model.layers.0.self_attn.k_proj.weight", "lm_head.weight"],
    ids=["plain", "stacked-into-qkv", "lm-head"],
)
def test_missing_tensor_is_named(name: str, llama_copy: Path) -> None:
    """A tensor stacked into a fused parameter (k_proj -> qkv_proj) is named as the checkpoint names it."""
    edit_tensors(llama_copy, lambda t: t.pop(name))
    with pytest.raises(WeightLoadError, match=r"missing 1 tensor\(s\)") as info:
        start(llama_copy)
    assert repr(name) in str(info.value)


def test_unexpected_tensor_is_named(llama_copy: Path) -> None:
    edit_tensors(llama_copy, lambda t: t.update({"model.layers.0.self_attn.rope_scale": torch.zeros(4)}))
    with pytest.raises(WeightLoadError) as info:
        start(llama_copy)
    message = str(info.value)
    assert "unexpected tensor 'model.layers.0.self_attn.rope_scale' in model.safetensors" in message
    assert "LlamaForCausalLM has no parameter for it" in message


@pytest.mark.parametrize(
    ("name", "bad_shape", "expected"),
    [("model.norm.weight", (63,), [64]), ("model.layers.0.self_attn.k_proj.weight", (3, 64), [32, 64])],
    ids=["replicated", "stacked-into-qkv"],
)
def test_wrong_shape_is_named(name: str, bad_shape: tuple[int, ...], expected: list[int], llama_copy: Path) -> None:
    edit_tensors(llama_copy, lambda t: t.update({name: torch.zeros(bad_shape)}))
    with pytest.raises(WeightLoadError) as info:
        start(llama_copy)
    message = str(info.value)
    assert f"tensor {name!r} in model.safetensors has shape {list(bad_shape)}" in message
    assert f"expects {expected}" in message


def _cut_data(raw: bytes) -> bytes:
    (header_len,) = struct.unpack("<Q", raw[:8])
    return raw[: 8 + header_len + (len(raw) - 8 - header_len) // 2]


def _cut_header(raw: bytes) -> bytes:
    (header_len,) = struct.unpack("<Q", raw[:8])
    return raw[: 8 + header_len // 2]


def _garbage_length(raw: bytes) -> bytes:
    return bytes(range(200, 240)) + raw[40:]


def _garbage_header(raw: bytes) -> bytes:
    return raw[:8] + b"\xff" * 32 + raw[40:]


@pytest.mark.parametrize(
    "damage",
    [_cut_data, _cut_header, _garbage_length, _garbage_header],
    ids=["truncated-in-data", "truncated-in-header", "garbage-header-length", "garbage-header-bytes"],
)
def test_corrupt_safetensors_file_is_named(damage: Callable[[bytes], bytes], llama_copy: Path) -> None:
    path = llama_copy / "model.safetensors"
    path.write_bytes(damage(path.read_bytes()))
    with pytest.raises(WeightLoadError) as info:
        start(llama_copy)
    message = str(info.value)
    assert f"{path} is not a readable safetensors file" in message
    assert "truncated or corrupt" in message


def test_missing_shard_named_in_index(tiny_checkpoint: Callable[..., Path], tmp_path: Path) -> None:
    model = Path(shutil.copytree(tiny_checkpoint(LLAMA, num_shards=2), tmp_path / "sharded"))
    (model / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(WeightLoadError) as info:
        start(model)
    message = str(info.value)
    assert "model.safetensors.index.json names model-00002-of-00002.safetensors" in message
    assert f"does not exist in {model}" in message


def test_no_safetensors_files(llama_copy: Path) -> None:
    (llama_copy / "model.safetensors").unlink()
    with pytest.raises(WeightLoadError) as info:
        start(llama_copy)
    message = str(info.value)
    assert f"no *.safetensors files in {llama_copy}" in message
    assert "load_format='dummy'" in message


def test_pt_file_pickling_an_object_is_refused(llama_copy: Path) -> None:
    """weights_only: a pickle holding anything but tensors is never unpickled."""
    (llama_copy / "model.safetensors").unlink()
    path = llama_copy / "pytorch_model.bin"
    torch.save({"model.norm.weight": torch.ones(64), "payload": Path("/etc/passwd")}, path)
    with pytest.raises(WeightLoadError) as info:
        start(llama_copy, load_format="pt")
    message = str(info.value)
    assert f"{path} could not be loaded with torch.load(weights_only=True)" in message
    assert "Unsupported global" in message and "pathlib" in message and "refuses to unpickle" in message
    assert "\n" not in message  # torch's many-line explanation is cut to the line that says why


def test_pt_file_that_is_not_a_checkpoint(llama_copy: Path) -> None:
    (llama_copy / "model.safetensors").unlink()
    path = llama_copy / "pytorch_model.bin"
    path.write_bytes(b"not a torch file at all")
    with pytest.raises(WeightLoadError, match=r"pytorch_model\.bin could not be loaded") as info:
        start(llama_copy, load_format="pt")
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("load_format", ["safetensors", "pt"])
def test_a_float64_tensor_is_refused_not_cast(load_format: str, llama_copy: Path) -> None:
    """A float64 tensor in a float32 checkpoint: engine_ref never runs in float64, so it refuses (not casts)."""
    name = "model.layers.0.input_layernorm.weight"
    edit_tensors(llama_copy, lambda t: t.update({name: t[name].double()}))
    path = llama_copy / "model.safetensors"
    if load_format == "pt":
        torch.save(load_file(path), llama_copy / "pytorch_model.bin")
        path.unlink()
        path = llama_copy / "pytorch_model.bin"
    with pytest.raises(WeightLoadError) as info:
        start(llama_copy, load_format=load_format)
    assert str(info.value) == (
        f"tensor {name!r} in {path} is stored as float64, which engine_ref does not run in (float32, float16, "
        f"bfloat16), and refuses to cast silently: convert the checkpoint (e.g. tensor.to(torch.float32)) and save "
        f"it again.")


def test_a_narrower_float_tensor_is_widened(llama_copy: Path, llama: Path) -> None:
    """Only float64 is refused: a bfloat16 tensor in a float32 checkpoint loads, exactly, as float32."""
    name = "model.norm.weight"
    edit_tensors(llama_copy, lambda t: t.update({name: t[name].bfloat16()}))
    with LLM(str(llama_copy), **SMALL_ENGINE) as llm:
        loaded = llm.engine.executor.worker.model.get_parameter(name)
        assert loaded.dtype == torch.float32
        assert torch.equal(loaded, load_file(llama / "model.safetensors")[name].bfloat16().float())


# -- good checkpoints -----------------------------------------------------------------------------


def test_sharded_checkpoint_gives_the_same_tokens(tiny_checkpoint: Callable[..., Path],
                                                  reference_tokens: list[list[int]]) -> None:
    model = tiny_checkpoint(LLAMA, num_shards=2)
    assert len(list(model.glob("model-0000?-of-00002.safetensors"))) == 2
    assert generate(model) == reference_tokens


def test_pt_checkpoint_gives_the_same_tokens(tiny_checkpoint: Callable[..., Path],
                                             reference_tokens: list[list[int]]) -> None:
    model = tiny_checkpoint(LLAMA, fmt="pt")
    assert not list(model.glob("*.safetensors"))
    assert generate(model, load_format="pt") == reference_tokens


def test_dummy_load_format_needs_no_weight_files(llama_copy: Path, reference_tokens: list[list[int]]) -> None:
    (llama_copy / "model.safetensors").unlink()
    with LLM(str(llama_copy), load_format="dummy", **SMALL_ENGINE) as llm:
        tokens = llm.generate(prompt_token_ids=PROMPTS, max_tokens=MAX_TOKENS, ignore_eos=True)
        assert llm.startup_report.workers[0].bytes_read == 0
        assert llm.startup_report.workers[0].memory.weights > 0
    assert [len(t) for t in tokens] == [MAX_TOKENS] * len(PROMPTS)
    assert all(0 <= t < 256 for seq in tokens for t in seq)


def _config(model: Path, **kwargs: Any) -> EngineConfig:
    return EngineArgs(model=str(model), **SMALL_ENGINE, **kwargs).create_engine_config()


def test_load_weights_covers_every_parameter(llama: Path) -> None:
    """The model's load_weights returns every parameter name; values land where the checkpoint says."""
    config = _config(llama)
    model = initialize_model(config, torch.device("cpu"))
    path = llama / "model.safetensors"
    stats = LoadStats()
    with safe_open(str(path), framework="pt") as f, torch.no_grad():
        names = list(f.keys())
        weights = ((n, CheckpointTensor(n, f.get_slice(n), f.get_slice(n).get_shape(), path.name, stats))
                   for n in names)
        loaded = model.load_weights(weights)
    assert loaded == {name for name, _ in model.named_parameters()}
    assert stats.tensors_read == len(names)
    assert stats.bytes_read == data_bytes(path)
    tensors = load_file(path)
    assert torch.equal(model.get_parameter("model.norm.weight"), tensors["model.norm.weight"])
    qkv = torch.cat([tensors[f"model.layers.1.self_attn.{p}_proj.weight"] for p in "qkv"])
    assert torch.equal(model.get_parameter("model.layers.1.self_attn.qkv_proj.weight"), qkv)


def test_loader_reads_each_byte_once_at_tp1(llama: Path) -> None:
    loader = get_model_loader(_config(llama).load_config)
    assert isinstance(loader, DefaultModelLoader)
    loader.load_model(_config(llama), torch.device("cpu"))
    assert loader.stats.bytes_read == data_bytes(llama / "model.safetensors")


def test_each_tp_rank_reads_only_its_shard(llama: Path) -> None:
    """Under a simulated TP=2 group each rank loads every parameter but reads well under the whole file."""
    config = _config(llama)
    total = data_bytes(llama / "model.safetensors")
    read = []
    for rank in range(2):
        with tensor_parallel_state(rank, 2):
            loader = get_model_loader(config.load_config)
            model = loader.load_model(config, torch.device("cpu"))
        read.append(loader.stats.bytes_read)
        assert loader.stats.bytes_read < 0.6 * total
        assert model.get_parameter("model.layers.0.self_attn.qkv_proj.weight").shape[0] == (64 + 2 * 32) // 2
    assert sum(read) >= total  # replicated tensors (norms) are read by both ranks


def test_dummy_loader_is_seeded(llama: Path) -> None:
    config = _config(llama, load_format="dummy")
    loader = get_model_loader(config.load_config)
    assert isinstance(loader, DummyModelLoader)
    first = loader.load_model(config, torch.device("cpu")).state_dict()
    second = get_model_loader(config.load_config).load_model(config, torch.device("cpu")).state_dict()
    assert first.keys() == second.keys()
    assert all(torch.equal(first[k], second[k]) for k in first)
    assert loader.stats.bytes_read == 0


# -- every checkpoint tensor consumed -------------------------------------------------------------------------------

Weights = Iterable[tuple[str, CheckpointTensor]]
INV_FREQ = "model.layers.1.self_attn.rotary_emb.inv_freq"  # transformers < 4.31 wrote it; Llama's mapper skips it


class BorrowsDownProjLlama(LlamaForCausalLM):
    """Planted: load_weights hands layer 0's down_proj to layer 1 too and drops layer 1's own; no parameter is left
    unloaded, so only the unconsumed tensor tells."""

    def load_weights(self, weights: Weights) -> set[str]:
        def borrowed() -> Iterator[tuple[str, CheckpointTensor]]:
            for name, tensor in weights:
                if name != "model.layers.1.mlp.down_proj.weight":
                    yield name, tensor
                if name == "model.layers.0.mlp.down_proj.weight":
                    yield "model.layers.1.mlp.down_proj.weight", tensor

        return super().load_weights(borrowed())


class DropsInvFreqLlama(LlamaForCausalLM):
    """Clean: drops the tensor its weights mapper declares unused before load_mapped_weights ever sees it."""

    def load_weights(self, weights: Weights) -> set[str]:
        return super().load_weights((name, tensor) for name, tensor in weights if name != INV_FREQ)


def load_with(model_cls: type[LlamaForCausalLM], checkpoint: Path, **kwargs: Any) -> LlamaForCausalLM:
    """``model_cls`` built and loaded by the engine's DefaultModelLoader from ``checkpoint``."""
    config = _config(checkpoint, **kwargs)
    with torch.device("cpu"), torch.no_grad():
        model = model_cls(config.model_config.hf_config)
        DefaultModelLoader(config.load_config).load_weights(model, config)
    return model


@pytest.mark.parametrize(("fmt", "num_shards", "file"), [
    ("safetensors", 1, "model.safetensors"), ("safetensors", 2, "model-00002-of-00002.safetensors"),
    ("pt", 1, "pytorch_model.bin")], ids=["safetensors", "sharded", "pt"])
def test_a_tensor_load_weights_drops_is_named_with_its_file_and_the_fix(
        fmt: str, num_shards: int, file: str, tiny_checkpoint: Callable[..., Path]) -> None:
    checkpoint = tiny_checkpoint(LLAMA, fmt=fmt, num_shards=num_shards)
    with pytest.raises(WeightLoadError) as info:
        load_with(BorrowsDownProjLlama, checkpoint, load_format=fmt)
    message = str(info.value)
    assert message.startswith("BorrowsDownProjLlama.load_weights did not consume 1 checkpoint tensor(s): "
                              f"'model.layers.1.mlp.down_proj.weight' ({file}).")
    assert "Consume each in load_weights" in message and "declare it unused in the model's weights_mapper" in message
    load_with(LlamaForCausalLM, checkpoint, load_format=fmt)  # the clean model consumes every tensor


@pytest.mark.parametrize("model_cls", [LlamaForCausalLM, DropsInvFreqLlama])
def test_a_tensor_the_weights_mapper_declares_unused_need_not_be_consumed(
        model_cls: type[LlamaForCausalLM], llama_copy: Path) -> None:
    edit_tensors(llama_copy, lambda t: t.update({INV_FREQ: torch.ones(8)}))
    model = load_with(model_cls, llama_copy)
    assert torch.equal(model.get_parameter("model.norm.weight"), load_file(llama_copy / "model.safetensors")[
        "model.norm.weight"])


def test_a_tied_checkpoint_may_hold_the_lm_head_it_does_not_load(tiny_checkpoint: Callable[..., Path],
                                                                 tmp_path: Path) -> None:
    qwen2 = Path(shutil.copytree(tiny_checkpoint("Qwen2ForCausalLM"), tmp_path / "qwen2"))  # tie_word_embeddings
    edit_tensors(qwen2, lambda t: t.update({"lm_head.weight": t["model.embed_tokens.weight"].clone()}))
    start(qwen2)


def test_a_rank_that_holds_no_vocabulary_rows_consumes_the_embedding_without_reading_it(tmp_path: Path) -> None:
    """vocab_size=5 at TP=4: rank 3's rows [6, 8) all lie past the vocabulary, so it reads nothing of
    embed_tokens or lm_head, and must not be told it left them unconsumed."""
    checkpoint = make_checkpoint(LLAMA, tmp_path / "vocab5", overrides={"vocab_size": 5})
    config = _config(checkpoint)
    with tensor_parallel_state(3, 4):
        loader = get_model_loader(config.load_config)
        model = loader.load_model(config, torch.device("cpu"))
    assert not model.get_parameter("model.embed_tokens.weight").any()
    assert not model.get_parameter("lm_head.weight").any()


def test_a_tensor_skipped_under_the_name_load_weights_gives_it_is_declared_unused(tiny_checkpoint: Callable[..., Path],
                                                                                    tmp_path: Path) -> None:
    """Llava's load_weights renames transformers 5's vision tower names to the Hub's before its weights mapper skips
    them: the unused post_layernorm, spelled as transformers 5 writes it, is declared unused all the same."""
    llava = Path(shutil.copytree(tiny_checkpoint("LlavaForConditionalGeneration"), tmp_path / "llava"))
    edit_tensors(llava, lambda t: t.update({"vision_tower.post_layernorm.weight": torch.ones(32)}))
    config = _config(llava)
    get_model_loader(config.load_config).load_model(config, torch.device("cpu"))
