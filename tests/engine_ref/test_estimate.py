"""The memory estimate: exact against transformers on published configs, equal to the engine's measurement.

- num_parameters equals transformers' count of the same config.json (built on the meta device), and
  the published size of each model; Llava's difference is the vision layer and norm it never uses.
- Per-rank weight and KV bytes follow the sharding rules, written out here independently.
- On tiny checkpoints, the estimate equals what the engine measures when it starts (TP 1 and 2,
  real rank processes): weights and KV bytes per token to the byte; the activation peak (and so the
  KV blocks) to the byte at TP 1, and at TP 2 up to one all-reduced activation that gloo released late.
- When a config does not fit, the category is the engine's, and max_model_len_estimate is the
  largest length the engine starts with (it refuses one more token).
- A 47B-parameter estimate runs in seconds with a small peak RSS; bad input gets a clear error.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from collections.abc import Callable
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine_ref import LLM
from engine_ref.engine.report import StartupReport
from engine_ref.entrypoints.cli import main
from engine_ref.errors import ConfigError, KVCacheTooSmallError, MissingConfigField, UnknownArchitectureError
from engine_ref.memory.compare import compare_with_report
from engine_ref.memory.estimate import estimate_memory
from engine_ref.memory.fake import FakeRunError, fake_tensors
from engine_ref.memory.result import JSON_KEYS, MemoryEstimate
from engine_ref.model_executor.model_loader.checkpoint import example_config
from engine_ref.model_executor.models.interfaces import REFERENCE_CONFIGS_DIR

PUBLISHED = REFERENCE_CONFIGS_DIR
# Sizes the model cards publish (transformers' count of the real checkpoints' config.json).
PUBLISHED_PARAMETERS = {
    "Meta-Llama-3-8B": 8_030_261_248,
    "Llama-3.1-8B": 8_030_261_248,
    "Mixtral-8x7B-v0.1": 46_702_792_704,
    "Qwen2-7B": 7_615_616_512,
    "Qwen2-0.5B": 494_032_768,
    "Qwen3-30B-A3B": 30_532_122_624,
    "llava-1.5-7b-hf": 7_063_427_072,
}
TEXT_MODELS = [name for name in PUBLISHED_PARAMETERS if not name.startswith("llava")]
ARCHITECTURES = ["LlamaForCausalLM", "Qwen2ForCausalLM", "MixtralForCausalLM", "Qwen3MoeForCausalLM",
                 "LlavaForConditionalGeneration"]
# Engine settings for tiny checkpoints: a profile batch of 600 tokens is 2 sequences of 256 and one of 88.
TINY = {"device_memory": "64MiB", "max_model_len": 256, "max_num_batched_tokens": 600}


def published(name: str) -> Path:
    return PUBLISHED / f"{name}.json"


@cache
def published_estimate(name: str, layers: int | None = None) -> MemoryEstimate:
    """The estimate of a published config at TP=2 on an 80 GiB device (computed once per session); ``layers``:
    with that many decoder layers instead of the published number (the estimate's time grows with the layers).
    Its tests read parameters and bytes, so its profile batch is one sequence (a fake run's time grows with the
    number of sequences)."""
    config = published_config(name, layers)
    return estimate_memory(config, device_memory="80GiB", tensor_parallel_size=2, dtype="bfloat16",
                           max_model_len=1024, max_num_batched_tokens=1024)


def published_config(name: str, layers: int | None = None) -> dict[str, Any]:
    """A published config.json, with ``layers`` decoder layers where given."""
    config = json.loads(published(name).read_text())
    return config if layers is None else {**config, "num_hidden_layers": layers}


@cache
def transformers_model(config_path: Path, layers: int | None = None) -> torch.nn.Module:
    """transformers' model for a config.json (with ``layers`` decoder layers where given), on the meta device
    (nothing allocated)."""
    import transformers

    config = transformers.AutoConfig.from_pretrained(str(config_path))
    if layers is not None:
        config.num_hidden_layers = layers
    with torch.device("meta"):
        return getattr(transformers, config.architectures[0])(config)


def parameter_count(module: torch.nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())  # parameters() yields a tied tensor once


def expected_rank_bytes(c: dict[str, Any], tp: int, itemsize: int) -> tuple[int, int, int]:
    """(weight bytes, buffer bytes, KV bytes per token) of one rank, from the sharding rules alone.

    Column/row-parallel matrices split by tp; embedding and LM head split by vocabulary rows, padded
    to a multiple of tp; KV heads replicated when fewer than tp; norms, routers and rotary buffers
    replicated. All layers share one rotary inv_freq (head_dim / 2 float32) buffer.
    """
    hidden, layers, vocab = c["hidden_size"], c["num_hidden_layers"], c["vocab_size"]
    heads = c["num_attention_heads"]
    kv_heads = c.get("num_key_value_heads") or heads
    head_dim = c.get("head_dim") or hidden // heads
    q_rank, kv_rank = heads // tp, (kv_heads // tp if kv_heads >= tp else 1)
    attention = (q_rank + 2 * kv_rank) * head_dim * hidden + hidden * q_rank * head_dim
    if c["model_type"] == "qwen2":
        attention += (q_rank + 2 * kv_rank) * head_dim  # q, k, v biases
    if c["model_type"] == "qwen3_moe":
        attention += 2 * head_dim  # q_norm, k_norm
    if c["model_type"] == "mixtral":
        experts, inter = c["num_local_experts"], c["intermediate_size"]
        mlp = experts * hidden + experts * 3 * hidden * (inter // tp)
    elif c["model_type"] == "qwen3_moe":
        experts, inter = c["num_experts"], c["moe_intermediate_size"]
        mlp = experts * hidden + experts * 3 * hidden * (inter // tp)
    else:
        mlp = 3 * hidden * (c["intermediate_size"] // tp)
    vocab_rows = -(-vocab // tp)
    heads_and_embedding = vocab_rows * hidden * (1 if c.get("tie_word_embeddings") else 2)
    params = heads_and_embedding + layers * (attention + mlp + 2 * hidden) + hidden
    buffers = (head_dim // 2) * 4
    return params * itemsize, buffers, 2 * layers * kv_rank * head_dim * itemsize


# -- exact against transformers ------------------------------------------------------------------


@pytest.mark.parametrize("name", TEXT_MODELS)
def test_num_parameters_equals_transformers(name: str) -> None:
    """The estimate of 1 and 2 decoder layers equals transformers' count of the same configs; their difference is
    one layer, so the rest plus the published number of layers is the published size, which transformers' count of
    the whole config also gives. (These decoders repeat one layer; the whole-size estimates of Mixtral-8x7B and
    Qwen2-0.5B are asserted below, in the 47B test and the CLI's.)"""
    one, two = published_estimate(name, layers=1), published_estimate(name, layers=2)
    for estimate, layers in ((one, 1), (two, 2)):
        assert estimate.num_parameters == parameter_count(transformers_model(published(name), layers))
    per_layer = two.num_parameters - one.num_parameters
    rest = one.num_parameters - per_layer
    layers = json.loads(published(name).read_text())["num_hidden_layers"]
    assert rest + layers * per_layer == PUBLISHED_PARAMETERS[name]
    assert parameter_count(transformers_model(published(name))) == PUBLISHED_PARAMETERS[name]
    assert two.architecture == json.loads(published(name).read_text())["architectures"][0]


def test_qwen2_tied_embeddings_are_counted_once() -> None:
    config = {**json.loads(published("Qwen2-0.5B").read_text()), "num_hidden_layers": 2}
    untied = estimate_memory({**config, "tie_word_embeddings": False}, device_memory="80GiB", max_model_len=64)
    tied = estimate_memory(config, device_memory="80GiB", max_model_len=64)
    embedding = config["vocab_size"] * config["hidden_size"]
    assert untied.num_parameters - tied.num_parameters == embedding
    assert untied.weight_bytes - tied.weight_bytes == embedding * 2


def test_llava_counts_what_it_uses_transformers_also_counts_the_unused_vision_layer() -> None:
    """vision_feature_layer=-2 reads the second-to-last CLIP layer, so (as vLLM does) engine_ref builds
    neither the last encoder layer nor post_layernorm; transformers builds both. The counts differ by
    exactly their parameters."""
    hf = transformers_model(published("llava-1.5-7b-hf"))
    config = json.loads(published("llava-1.5-7b-hf").read_text())
    assert config["vision_feature_layer"] == -2
    vision = hf.model.vision_tower  # transformers 5's CLIPVisionModel (4.x nested it in .vision_model)
    vision = getattr(vision, "vision_model", vision)
    unused = parameter_count(vision.encoder.layers[-1]) + parameter_count(vision.post_layernorm)
    # the layer: 4 x (1024^2 + 1024) attention, 2 x 1024 x 4096 + 4096 + 1024 MLP, 2 x 2 x 1024 norms;
    # post_layernorm: 2 x 1024
    assert unused == 12_598_272
    estimate = published_estimate("llava-1.5-7b-hf")
    assert parameter_count(hf) == PUBLISHED_PARAMETERS["llava-1.5-7b-hf"]
    assert estimate.num_parameters == parameter_count(hf) - unused


@pytest.mark.parametrize("name", ["Meta-Llama-3-8B", "Qwen2-7B", "Qwen2-0.5B", "Mixtral-8x7B-v0.1", "Qwen3-30B-A3B"])
def test_weight_and_kv_bytes_per_rank_follow_the_sharding(name: str) -> None:
    """On the published configs with 2 decoder layers: every layer is sharded alike, and so is layer 2 of 2."""
    config = published_config(name, layers=2)
    estimate = published_estimate(name, layers=2)
    weights, buffers, kv_per_token = expected_rank_bytes(config, 2, itemsize=2)
    assert estimate.weight_bytes_per_rank == [weights, weights]
    assert estimate.buffer_bytes_per_rank == [buffers, buffers]
    assert estimate.kv_cache_bytes_per_token_per_rank == [kv_per_token, kv_per_token]
    whole, whole_buffers, _ = expected_rank_bytes(config, 1, itemsize=2)
    assert (estimate.weight_bytes, estimate.buffer_bytes) == (whole, whole_buffers)
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    assert estimate.weight_bytes == estimate.num_parameters * 2
    assert estimate.buffer_bytes == head_dim // 2 * 4  # one rotary table, shared by every layer


def test_vocabulary_padding_and_kv_head_replication() -> None:
    """257 vocabulary rows over 4 ranks: 65 each (the last rank has 2 padding rows); 2 KV heads over
    4 ranks: each rank holds one, each head on two ranks."""
    config = {**example_config("LlamaForCausalLM"), "vocab_size": 257}
    estimate = estimate_memory(config, device_memory="64MiB", tensor_parallel_size=4, max_model_len=64)
    weights, buffers, kv_per_token = expected_rank_bytes(config, 4, itemsize=4)
    assert estimate.weight_bytes_per_rank == [weights] * 4
    assert estimate.buffer_bytes_per_rank == [buffers] * 4
    assert estimate.kv_cache_bytes_per_token_per_rank == [kv_per_token] * 4
    assert kv_per_token == 2 * 2 * 1 * 16 * 4


TINY_FAMILY = st.fixed_dictionaries({
    "model_type": st.sampled_from(["llama", "qwen2", "mixtral"]),
    "num_hidden_layers": st.integers(1, 3),
    "kv_heads": st.sampled_from([1, 2, 4]),
    "groups": st.sampled_from([1, 2]),
    "head_dim": st.sampled_from([8, 16]),
    "intermediate": st.sampled_from([16, 48]),
    "vocab_size": st.integers(17, 300),
    "tie_word_embeddings": st.booleans(),
    "tp": st.sampled_from([1, 2, 4]),
})


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(TINY_FAMILY)
def test_random_configs_exact_against_transformers_and_sharding(draw: dict[str, Any]) -> None:
    import transformers

    heads = draw["kv_heads"] * draw["groups"]
    tp = min(draw["tp"], heads)
    arch = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "mixtral": "MixtralForCausalLM"}
    config = {
        **example_config(arch[draw["model_type"]]), "num_hidden_layers": draw["num_hidden_layers"],
        "num_attention_heads": heads, "num_key_value_heads": draw["kv_heads"],
        "hidden_size": heads * draw["head_dim"], "intermediate_size": draw["intermediate"],
        "vocab_size": draw["vocab_size"], "tie_word_embeddings": draw["tie_word_embeddings"],
        "max_position_embeddings": 64,
    }
    # parameters and bytes only: a profile batch of one sequence (the default would run 64 of 32 tokens)
    estimate = estimate_memory(config, device_memory="64MiB", tensor_parallel_size=tp, max_model_len=32,
                               max_num_batched_tokens=32)
    hf_config = transformers.AutoConfig.for_model(**config)
    with torch.device("meta"):
        hf = getattr(transformers, config["architectures"][0])(hf_config)
    assert estimate.num_parameters == parameter_count(hf)
    weights, buffers, kv_per_token = expected_rank_bytes(config, tp, itemsize=4)
    assert estimate.weight_bytes_per_rank == [weights] * tp
    assert estimate.buffer_bytes_per_rank == [buffers] * tp
    assert estimate.kv_cache_bytes_per_token_per_rank == [kv_per_token] * tp


# -- equal to the measurement ------------------------------------------------------------------------


def assert_equals_measurement(estimate: MemoryEstimate, report: StartupReport) -> None:
    """Weights and KV bytes per token equal to the byte on every rank; the activation peak too at TP=1.

    At TP > 1 a rank may measure up to one all-reduced activation more than the estimate, never less:
    gloo's worker thread can release the tensor it reduced after the rank's next allocation (a race of
    the real run; a few profile runs in a hundred here). The KV cache then holds the blocks that costs.
    """
    comparison = compare_with_report(estimate, report)  # activation tolerance: estimate.all_reduce_bytes
    assert comparison.ok, comparison.describe()
    config = json.loads((Path(report.model) / "config.json").read_text())
    hidden = config.get("text_config", config)["hidden_size"]
    itemsize = getattr(torch, estimate.dtype).itemsize
    tp = estimate.tensor_parallel_size
    assert estimate.all_reduce_bytes == (0 if tp == 1 else estimate.max_num_batched_tokens * hidden * itemsize)
    for worker in report.workers:
        rank, measured = worker.rank, worker.memory
        assert measured.weights == estimate.weight_bytes_per_rank[rank]
        assert measured.buffers == estimate.buffer_bytes_per_rank[rank] > 0
        late = measured.activation_peak - estimate.activation_peak_bytes_per_rank[rank]
        assert 0 <= late <= estimate.all_reduce_bytes, (rank, late)
        per_block = estimate.kv_cache_bytes_per_token_per_rank[rank] * estimate.block_size
        assert measured.kv_cache == report.num_gpu_blocks * per_block
        if max(w.memory.activation_peak for w in report.workers) == max(estimate.activation_peak_bytes_per_rank):
            assert measured.kv_cache == estimate.kv_cache_bytes_per_rank[rank]
            assert report.num_gpu_blocks == estimate.num_gpu_blocks


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_estimate_equals_measurement(tiny_checkpoint: Callable[..., Path], architecture: str, tp: int) -> None:
    model = tiny_checkpoint(architecture)
    with LLM(str(model), tensor_parallel_size=tp, **TINY) as llm:
        report = llm.startup_report
    estimate = estimate_memory(model, tensor_parallel_size=tp, **TINY)
    assert_equals_measurement(estimate, report)
    assert len(report.workers) == tp and all(w.memory.activation_peak > 0 for w in report.workers)


def test_estimate_equals_measurement_in_bfloat16(tiny_checkpoint: Callable[..., Path]) -> None:
    model = tiny_checkpoint("MixtralForCausalLM", dtype="bfloat16")
    with LLM(str(model), tensor_parallel_size=2, **TINY) as llm:
        report = llm.startup_report
    estimate = estimate_memory(model, tensor_parallel_size=2, **TINY)
    assert estimate.dtype == "bfloat16"
    assert_equals_measurement(estimate, report)


def test_gathered_logits_cost_the_same_when_simulated(tiny_checkpoint: Callable[..., Path]) -> None:
    """Many short sequences and a large vocabulary make the gathered logits the activation peak. A real
    all_gather allocates one buffer per rank before concatenating; the simulated one must too."""
    model = tiny_checkpoint("Qwen2ForCausalLM", overrides={"vocab_size": 32000})
    settings_ = {"tensor_parallel_size": 2, "device_memory": "256MiB", "max_model_len": 16,
                 "max_num_batched_tokens": 512}
    with LLM(str(model), **settings_) as llm:
        report = llm.startup_report
    estimate = estimate_memory(model, **settings_)
    assert_equals_measurement(estimate, report)
    logits = 32 * 32000 * 4  # 32 sequences' float32 logits over the whole vocabulary
    assert estimate.activation_peak_bytes_per_rank[0] > 2 * logits > 8 * estimate.all_reduce_bytes


def test_compare_with_report_finds_differences_and_refuses_other_arguments(
        tiny_checkpoint: Callable[..., Path]) -> None:
    model = tiny_checkpoint("LlamaForCausalLM")
    with LLM(str(model), **TINY) as llm:
        report = llm.startup_report
    estimate = estimate_memory(model, **TINY)
    off = dataclasses.replace(estimate, weight_bytes_per_rank=[estimate.weight_bytes_per_rank[0] + 2],
                              buffer_bytes_per_rank=[estimate.buffer_bytes_per_rank[0] + 1],
                              activation_peak_bytes_per_rank=[estimate.activation_peak_bytes_per_rank[0] - 100])
    comparison = compare_with_report(off, report)  # TP=1: no tolerance
    assert not comparison.ok
    assert [(d.category, d.measured - d.estimated) for d in comparison.mismatches] == [
        ("weights", -2), ("buffers", -1), ("activation_peak", 100)]
    assert "rank 0 weights: estimated" in comparison.describe()
    assert compare_with_report(off, report, activation_atol=100).mismatches[0].category == "weights"
    other = estimate_memory(model, **{**TINY, "max_model_len": 128})
    with pytest.raises(ConfigError, match=r"max_model_len 128 \(estimate\) vs 256 \(report\)"):
        compare_with_report(other, report)


# -- fit, overflow, and the largest max_model_len ------------------------------------------------------


@pytest.fixture(scope="module")
def llama_4k(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Llama with 4096 positions: its profile batch (and activation peak) grows with max_model_len."""
    from engine_ref import make_checkpoint

    return make_checkpoint("LlamaForCausalLM", tmp_path_factory.mktemp("llama4k"),
                           overrides={"max_position_embeddings": 4096})


def test_largest_max_model_len_is_the_one_the_engine_starts_with(llama_4k: Path) -> None:
    estimate = estimate_memory(llama_4k, device_memory="10MiB", max_model_len=4096)
    assert not estimate.fits and estimate.overflow == "activation_peak"
    assert "activation peak" in estimate.reason and "4096 tokens" in estimate.reason
    with pytest.raises(KVCacheTooSmallError, match="No memory is left"):
        LLM(str(llama_4k), device_memory="10MiB", max_model_len=4096)
    largest = estimate.max_model_len_estimate
    assert 2048 < largest < 4096
    with LLM(str(llama_4k), device_memory="10MiB", max_model_len=largest) as llm:
        assert llm.startup_report.num_gpu_blocks * 16 >= largest
    with pytest.raises(KVCacheTooSmallError, match=f"max_model_len {largest + 1}"):
        LLM(str(llama_4k), device_memory="10MiB", max_model_len=largest + 1)
    assert estimate_memory(llama_4k, device_memory="10MiB", max_model_len=largest).fits
    beyond = estimate_memory(llama_4k, device_memory="10MiB", max_model_len=largest + 1)
    assert beyond.overflow == "kv_cache" and beyond.max_model_len_estimate == largest


def test_kv_cache_overflow_matches_the_engine(llama_4k: Path) -> None:
    estimate = estimate_memory(llama_4k, device_memory="15MiB", max_model_len=4096)
    assert (estimate.fits, estimate.overflow) == (False, "kv_cache")
    assert 0 < estimate.num_gpu_blocks * 16 < estimate.max_model_len_estimate < 4096
    assert "one request of max_model_len 4096 needs" in estimate.reason
    with pytest.raises(KVCacheTooSmallError, match="To serve at least one request with max_model_len 4096"):
        LLM(str(llama_4k), device_memory="15MiB", max_model_len=4096)
    fits = estimate_memory(llama_4k, device_memory="24MiB", max_model_len=4096)
    assert fits.fits and fits.reason is None and fits.max_model_len_estimate == 4096
    assert fits.max_concurrency == fits.num_gpu_blocks * 16 / 4096 > 1


def test_weights_overflow_leaves_no_length(tiny_checkpoint: Callable[..., Path]) -> None:
    estimate = estimate_memory(tiny_checkpoint("LlamaForCausalLM"), device_memory="400KB", max_model_len=64)
    assert (estimate.fits, estimate.overflow, estimate.max_model_len_estimate) == (False, "weights", 0)
    assert estimate.num_gpu_blocks == 0 and estimate.max_concurrency == 0
    assert "weights of rank 0" in estimate.reason and "raise tensor_parallel_size" in estimate.reason


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads the peak RSS from /proc (Linux)")
def test_a_47b_model_is_estimated_without_allocating_it() -> None:
    """Mixtral-8x7B (87 GiB of bfloat16 weights) at TP 2, with a 32768-token profile batch, in a child process.
    How long it takes depends on the machine: ``python benchmarks/estimate.py`` measures it.

    The child reports its own peak RSS from /proc/self/status (VmHWM): getrusage's ru_maxrss would
    include this test process's, which Linux carries across the fork and exec that start the child.
    """
    child = f"""
import json, re
from engine_ref.memory.estimate import estimate_memory
estimate = estimate_memory({str(published('Mixtral-8x7B-v0.1'))!r}, device_memory="80GiB", tensor_parallel_size=2,
                           dtype="bfloat16", max_model_len=32768)
peak_kib = int(re.search(r"VmHWM:\\s+(\\d+) kB", open("/proc/self/status").read()).group(1))
print(json.dumps({{"estimate": estimate.to_dict(), "max_rss_bytes": peak_kib * 1024}}))
"""
    result = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    estimate = data["estimate"]
    assert estimate["num_parameters"] == PUBLISHED_PARAMETERS["Mixtral-8x7B-v0.1"]
    assert estimate["fits"] and estimate["weight_bytes"] > 90e9
    assert 100e6 < data["max_rss_bytes"] < 1 << 30, data["max_rss_bytes"]  # not one full-size layer was allocated


# -- inputs and errors --------------------------------------------------------------------------------


def test_a_dict_a_file_and_a_directory_give_the_same_estimate(tiny_checkpoint: Callable[..., Path]) -> None:
    model = tiny_checkpoint("Qwen2ForCausalLM")
    config = json.loads((model / "config.json").read_text())
    by_dir = estimate_memory(model, **TINY)
    assert estimate_memory(model / "config.json", **TINY) == by_dir
    assert estimate_memory(config, **TINY) == by_dir
    assert by_dir.to_dict()["dtype"] == "float32"
    assert estimate_memory(config, **TINY, dtype="bfloat16").weight_bytes < by_dir.weight_bytes


def test_an_architecture_of_another_registry(tiny_checkpoint: Callable[..., Path]) -> None:
    """The plugin estimates the models of the engine it checks: any ModelRegistry, not only engine_ref's."""
    from engine_ref.model_executor.models.llama import LlamaForCausalLM
    from engine_ref.model_executor.models.registry import _ModelRegistry

    registry = _ModelRegistry({})
    registry.register_model("MyLlamaForCausalLM", LlamaForCausalLM)
    config = json.loads((tiny_checkpoint("LlamaForCausalLM") / "config.json").read_text())
    mine = estimate_memory({**config, "architectures": ["MyLlamaForCausalLM"]}, registry=registry, **TINY)
    assert dataclasses.replace(mine, architecture="LlamaForCausalLM") == estimate_memory(config, **TINY)
    with pytest.raises(UnknownArchitectureError, match="Registered: MyLlamaForCausalLM"):
        estimate_memory(config, registry=registry, **TINY)


def write_config(tmp_path: Path, config: dict[str, Any]) -> Path:
    path = tmp_path / "my-model.json"
    path.write_text(json.dumps(config))
    return path


def llama_3() -> dict[str, Any]:
    return json.loads(published("Meta-Llama-3-8B").read_text())


def test_unknown_architecture(tmp_path: Path) -> None:
    path = write_config(tmp_path, {**llama_3(), "architectures": ["LlamaForCausalLm"]})
    with pytest.raises(UnknownArchitectureError, match=r"'LlamaForCausalLm' is not registered\. Did you mean "
                                                       r"LlamaForCausalLM"):
        estimate_memory(path, device_memory="80GiB")


@pytest.mark.parametrize(("drop", "field"), [("hidden_size", "hidden_size"), ("intermediate_size", "intermediate_size"),
                                             ("architectures", "architectures")])
def test_missing_fields_are_named(tmp_path: Path, drop: str, field: str) -> None:
    config = llama_3()
    del config[drop]
    path = write_config(tmp_path, config)
    with pytest.raises(ConfigError, match=f"'{field}'") as info:
        estimate_memory(path, device_memory="80GiB", max_model_len=64)
    assert "engine_ref-estimate-" not in str(info.value)  # the user's file is named, not a temporary copy
    if drop != "architectures":
        assert isinstance(info.value, MissingConfigField)
        assert "add it to config.json" in str(info.value)


def test_missing_moe_field_is_named() -> None:
    config = json.loads(published("Mixtral-8x7B-v0.1").read_text())
    del config["num_local_experts"]
    with pytest.raises(MissingConfigField, match="'num_local_experts'"):
        estimate_memory(config, device_memory="80GiB", max_model_len=64)


def test_tensor_parallel_size_that_does_not_divide_the_heads() -> None:
    with pytest.raises(ConfigError, match=r"tensor_parallel_size=3 does not divide num_attention_heads=32 or "
                                          r"intermediate_size=14336 .* of LlamaForCausalLM; use one of \[1, 2, 4, 8"):
        estimate_memory(published("Meta-Llama-3-8B"), device_memory="80GiB", tensor_parallel_size=3)


def test_tensor_parallel_size_that_divides_the_heads_but_not_the_mlp() -> None:
    with pytest.raises(ConfigError, match=r"tensor_parallel_size=14 does not divide intermediate_size=4864 of "
                                          r"Qwen2ForCausalLM; use one of \[1, 2\]"):
        estimate_memory(published("Qwen2-0.5B"), device_memory="80GiB", tensor_parallel_size=14, max_model_len=64)


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"device_memory": None}, "device_memory is required"),
    ({"device_memory": "80 gigs"}, "device_memory='80 gigs' is not a size"),
    ({"device_memory": "0GiB"}, "device_memory='0GiB' must be larger than zero"),
    ({"device_memory": -5}, "device_memory=-5 must be a positive number of bytes"),
    ({"gpu_memory_utilization": 1.5}, r"gpu_memory_utilization=1.5 must be in \(0, 1\]"),
    ({"block_size": 0}, "block_size=0 must be a positive integer"),
    ({"tensor_parallel_size": 0}, "tensor_parallel_size=0 must be a positive integer"),
    ({"max_model_len": 10000}, "max_model_len=10000 exceeds max_position_embeddings=8192"),
    ({"max_model_len": 4096, "max_num_batched_tokens": 1024}, "max_num_batched_tokens=1024 is smaller than"),
    ({"dtype": "int8"}, "dtype='int8' is not supported"),
])
def test_malformed_arguments(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        estimate_memory(published("Meta-Llama-3-8B"), **{"device_memory": "80GiB", **kwargs})


@pytest.mark.parametrize(("override", "message"), [
    ({"hidden_size": "4096"}, "hidden_size='4096' must be a positive integer"),
    ({"num_hidden_layers": 0}, "num_hidden_layers=0 must be a positive integer"),
    ({"intermediate_size": -14336}, "config.json has sizes that must be positive: intermediate_size=-14336"),
])
def test_malformed_sizes_in_config_json(override: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        estimate_memory({**llama_3(), **override}, device_memory="80GiB", max_model_len=64)


def test_unreadable_inputs(tmp_path: Path) -> None:
    (tmp_path / "broken.json").write_text("{not json")
    with pytest.raises(ConfigError, match=r"broken.json is not valid JSON"):
        estimate_memory(tmp_path / "broken.json", device_memory="80GiB")
    with pytest.raises(ConfigError, match=r"is neither a config\.json file nor a model directory"):
        estimate_memory(tmp_path / "nowhere.json", device_memory="80GiB")


# -- the command line ---------------------------------------------------------------------------------


def test_cli_json_has_exactly_the_documented_keys(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["estimate", str(published("Qwen2-0.5B")), "--tensor-parallel-size", "2", "--dtype", "bfloat16",
                 "--device-memory", "8GiB", "--max-model-len", "1024", "--json"])
    data = json.loads(capsys.readouterr().out)
    assert code == 0
    assert tuple(data) == JSON_KEYS
    assert data["num_parameters"] == PUBLISHED_PARAMETERS["Qwen2-0.5B"]
    assert len(data["weight_bytes_per_rank"]) == len(data["activation_peak_bytes_per_rank"]) == 2
    assert len(data["buffer_bytes_per_rank"]) == 2 and data["buffer_bytes"] > 0
    assert data["fits"] is True and data["reason"] is None and data["max_model_len_estimate"] == 1024


def test_cli_table_and_exit_status_when_it_does_not_fit(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["estimate", str(published("Mixtral-8x7B-v0.1")), "--device-memory", "80GiB",
                 "--max-model-len", "1024"])
    out = capsys.readouterr().out
    assert code == 1
    assert "46,702,792,704 parameters" in out and "does NOT fit: the weights of rank 0" in out
    assert "largest max_model_len that fits: 0" in out


def test_cli_bad_input_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["estimate", str(published("Meta-Llama-3-8B")), "--device-memory", "lots"])
    err = capsys.readouterr().err
    assert code == 2
    assert err.startswith("engine-ref: error: device_memory='lots' is not a size") and err.count("\n") == 1


# -- fake tensors with known values -----------------------------------------------------------------------


def test_fake_run_knows_token_derived_values_and_allocates_nothing() -> None:
    with fake_tensors():
        ids = torch.tensor([5, 3, 5, 9])
        big = torch.empty(1 << 40, dtype=torch.bfloat16)  # 2 TiB, were it real
        assert ids.unique().tolist() == [3, 5, 9]
        assert int((ids == 5).sum()) == 2
        rows, = torch.where(ids == 5)
        assert rows.tolist() == [0, 2] and big.shape == (1 << 40,)
        scores = torch.empty(4, 8)  # activations: values unknown, every row assumed alike
        _, experts = torch.topk(scores, 2)
        assert experts.unique().tolist() == [0, 1]
        assert torch.where(experts == 1)[0].shape == (4,)


def test_fake_run_refuses_a_value_it_cannot_know() -> None:
    with fake_tensors(), pytest.raises(FakeRunError, match="computed from floating-point activations"):
        activations = torch.empty(4, 8)
        if (activations > 0).any():
            pass
