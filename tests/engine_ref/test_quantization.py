"""Weight quantization (fp8 per tensor, fbgemm_fp8 per channel, int8 per channel) on real tiny checkpoints.

Bounds used below, derived from the formats (s: an element's scale, amax / qmax):
- float8_e4m3fn has 3 mantissa bits: a normal value's step is 2^-3 of its binade, so rounding is off
  by at most 2^-4 |x|; below 2^-6 (subnormals) the step is 2^-9, so at most 2^-10. In weight units:
  |W - deq(W)| <= max(2^-4 |W|, 2^-10 s).
- int8, round to nearest: |W - deq(W)| <= s / 2.
Both plus float32 rounding of the divide and multiply (2^-22 |W|). A matmul then errs by at most
|x| @ bound^T. Logits: to first order each quantized matmul on a token's path (q/k/v, o, gate/up,
down per layer) adds its relative weight error eps = ||deq(W) - W|| / ||W||; the logits' relative
error stays under the sum of eps along the path (RMSNorm renormalises between layers).
"""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from engine_ref.config import HFConfig
from engine_ref.distributed.parallel_state import tensor_parallel_state
from engine_ref.engine.arg_utils import EngineArgs
from engine_ref.engine.report import StartupReport
from engine_ref.entrypoints.cli import main
from engine_ref.entrypoints.llm import LLM
from engine_ref.errors import QuantizationError, WeightLoadError, WorkerStartupError
from engine_ref.memory.accounting import storage_bytes
from engine_ref.memory.compare import compare_with_report
from engine_ref.memory.estimate import estimate_memory
from engine_ref.model_executor.forward_context import AttentionMetadata, set_forward_context
from engine_ref.model_executor.layers.linear import QKVParallelLinear, UnquantizedLinearMethod
from engine_ref.model_executor.layers.quantization import (
    QUANTIZATION_METHODS,
    get_quant_config,
    get_quantization_config,
)
from engine_ref.model_executor.layers.quantization.base_config import QuantizationConfig, process_weights_after_loading
from engine_ref.model_executor.layers.quantization.fp8 import Fp8Config
from engine_ref.model_executor.layers.quantization.scaled import ScaledQuantizationConfig
from engine_ref.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding
from engine_ref.model_executor.model_loader.quantized_checkpoint import make_quantized_checkpoint
from engine_ref.model_executor.model_loader.weight_utils import CheckpointTensor
from engine_ref.model_executor.models.interfaces import REFERENCE_CONFIGS_DIR
from engine_ref.model_executor.models.registry import ModelRegistry
from pytest_enginecheck.multirank import run_multirank
from pytest_enginecheck.targets.engine_ref.quant_check import matmul_weights, prompt_logits, relative_error

ARCHS = ["LlamaForCausalLM", "Qwen2ForCausalLM", "MixtralForCausalLM"]
PROMPT = [1, 5, 9, 13, 17, 3]
FLOAT32_ROUNDING = 2.0**-22


# -- helpers ---------------------------------------------------------------------------------------

def checkpoint_weights(model_dir: Path) -> Iterator[tuple[str, CheckpointTensor]]:
    for path in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            for name in sorted(f.keys()):
                tensor_slice = f.get_slice(name)
                yield name, CheckpointTensor(name, tensor_slice, tensor_slice.get_shape(), path.name)


def load_model(model_dir: Path, quantization: str | None = None, device: str = "cpu") -> torch.nn.Module:
    """This rank's model (the current TP group) from a tiny checkpoint, quantized as the engine will."""
    hf_config = HFConfig.from_file(model_dir / "config.json")
    quant_config = get_quant_config(quantization, hf_config.get("quantization_config"))
    model_cls = ModelRegistry.resolve_model_cls(hf_config["architectures"][0])
    previous = torch.get_default_dtype()
    torch.set_default_dtype(getattr(torch, hf_config["torch_dtype"]))
    try:
        with torch.device(device), torch.no_grad():
            model = model_cls(hf_config, **({} if quant_config is None else {"quant_config": quant_config}))
            if device != "meta":
                model.load_weights(checkpoint_weights(model_dir))
            process_weights_after_loading(model)
    finally:
        torch.set_default_dtype(previous)
    return model.eval()


def logits(model: torch.nn.Module, token_ids: list[int] = PROMPT) -> torch.Tensor:
    with set_forward_context(AttentionMetadata([0, len(token_ids)], [len(token_ids)])), torch.no_grad():
        return model.compute_logits(model(torch.tensor(token_ids), torch.arange(len(token_ids))))


def file_bytes(model_dir: Path) -> int:
    """Bytes of tensor data in the checkpoint (each tensor's numel times its dtype's size)."""
    return sum(t.numel() * t.element_size() for t in load_file(str(model_dir / "model.safetensors")).values())


def weight_bytes(model: torch.nn.Module) -> int:
    """Parameter bytes as the worker's memory accounting counts them (tensor storage, each once)."""
    return storage_bytes(model.parameters())


def quant_config(method: str) -> ScaledQuantizationConfig:
    config = get_quantization_config(method)()
    assert isinstance(config, ScaledQuantizationConfig)
    return config


def error_bound(config: ScaledQuantizationConfig, weight: torch.Tensor, scale_rows: torch.Tensor) -> torch.Tensor:
    """Largest |W - deq(W)| per element, from the format (module docstring)."""
    if config.weight_dtype == torch.int8:
        rounding = scale_rows.expand_as(weight) / 2
    else:
        rounding = torch.maximum(2.0**-4 * weight.abs(), 2.0**-10 * scale_rows.expand_as(weight))
    return rounding + FLOAT32_ROUNDING * weight.abs()


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """``checkpoints(arch, method=None, dtype="float32")``: the unquantized tiny checkpoint, or its quantized twin."""
    from engine_ref.model_executor.model_loader.checkpoint import make_checkpoint

    made: dict[tuple[str, str | None, str], Path] = {}

    def make(architecture: str, method: str | None = None, dtype: str = "float32") -> Path:
        key = (architecture, method, dtype)
        if key not in made:
            path = tmp_path_factory.mktemp(f"{architecture}-{method}-{dtype}")
            made[key] = (make_checkpoint(architecture, path, dtype=dtype) if method is None
                         else make_quantized_checkpoint(architecture, path, method, dtype=dtype))
        return made[key]

    return make


# -- one layer -------------------------------------------------------------------------------------

@pytest.mark.parametrize("method", QUANTIZATION_METHODS)
def test_layer_quantize_dequantize_within_format_bounds(method: str) -> None:
    """A qkv layer quantized on the fly: every weight within the format's bound, the matmul within |x| @ bound."""
    config = quant_config(method)
    generator = torch.Generator().manual_seed(0)
    heads, kv_heads, head_dim, hidden = 4, 2, 16, 64
    # Sub-projections of different magnitudes, some tiny values: per-tensor scales must stay per sub-projection.
    parts = {"q": torch.randn(heads * head_dim, hidden, generator=generator),
             "k": 10 * torch.randn(kv_heads * head_dim, hidden, generator=generator),
             "v": 1e-3 * torch.randn(kv_heads * head_dim, hidden, generator=generator)}
    layer = QKVParallelLinear(hidden, head_dim, heads, kv_heads, bias=True, quant_config=config, prefix="qkv_proj")
    with torch.no_grad():
        for shard_id, tensor in parts.items():
            layer.weight_loader(layer.weight, CheckpointTensor.from_tensor(f"{shard_id}_proj.weight", tensor, "mem"),
                                shard_id)
            bias = CheckpointTensor.from_tensor(f"{shard_id}_proj.bias", torch.zeros(tensor.shape[0]), "mem")
            layer.weight_loader(layer.bias, bias, shard_id)
        process_weights_after_loading(layer)
    assert layer.weight.dtype == config.weight_dtype
    groups = [heads * head_dim, kv_heads * head_dim, kv_heads * head_dim]
    scale = layer.get_parameter("weight_scale")
    assert scale.shape == ((sum(groups), 1) if config.per_channel else (3,))
    full = torch.cat(list(parts.values()))
    rows = config.scale_rows(scale, groups)
    dequantized = config.dequantize(layer.weight, scale, groups, torch.float32)
    error = (dequantized - full).abs()
    assert (error <= error_bound(config, full, rows)).all(), error.max()
    # The largest magnitude of each scale group maps to +-qmax exactly.
    assert torch.allclose(layer.weight.float().abs().amax(), torch.tensor(config.qmax))
    x = torch.randn(5, hidden, generator=generator)
    y = layer(x)
    assert torch.equal(y, x @ dequantized.T + layer.bias)
    assert ((y - x @ full.T).abs() <= x.abs() @ error_bound(config, full, rows).T * (1 + 1e-5)).all()


def test_unquantized_layers_keep_the_plain_path() -> None:
    """No quant_config: the model-dtype weight and F.linear, as before quantization existed."""
    layer = QKVParallelLinear(64, 16, 4, 2)
    assert isinstance(layer.quant_method, UnquantizedLinearMethod)
    assert [name for name, _ in layer.named_parameters()] == ["weight"]
    assert layer.weight.dtype == torch.float32


# -- whole models: on the fly == pre-quantized, bytes, logits --------------------------------------

@pytest.mark.parametrize("method", QUANTIZATION_METHODS)
@pytest.mark.parametrize("architecture", ARCHS)
def test_on_the_fly_equals_prequantized(architecture: str, method: str, checkpoints: Callable[..., Path]) -> None:
    base, prequantized = checkpoints(architecture), checkpoints(architecture, method)
    on_the_fly, loaded = load_model(base, method), load_model(prequantized)
    fly_state, loaded_state = on_the_fly.state_dict(), loaded.state_dict()
    assert fly_state.keys() == loaded_state.keys()
    assert [name for name, tensor in fly_state.items() if not same(tensor, loaded_state[name])] == []
    quantized = [n for n, t in fly_state.items() if t.dtype == quant_config(method).weight_dtype]
    assert any("qkv_proj" in n for n in quantized) and any("down_proj" in n or "w2" in n for n in quantized)
    assert torch.equal(logits(on_the_fly), logits(loaded))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("method", QUANTIZATION_METHODS)
@pytest.mark.parametrize("architecture", ARCHS)
def test_weight_bytes_are_exact(architecture: str, method: str, dtype: str, checkpoints: Callable[..., Path]) -> None:
    """Measured weight bytes = the pre-quantized checkpoint's bytes (1 per 8-bit weight, 4 per scale),
    also from a bf16 checkpoint converted at startup, and also for the model built on the meta device."""
    base, prequantized = checkpoints(architecture, None, dtype), checkpoints(architecture, method, dtype)
    expected = file_bytes(prequantized)
    assert weight_bytes(load_model(prequantized)) == expected
    assert weight_bytes(load_model(base, method)) == expected
    with tensor_parallel_state(0, 1):
        assert weight_bytes(load_model(base, method, device="meta")) == expected
    unquantized = weight_bytes(load_model(base))
    assert expected < unquantized * (0.5 if dtype == "float32" else 0.8)


@pytest.mark.parametrize("method", QUANTIZATION_METHODS)
@pytest.mark.parametrize("architecture", ARCHS)
def test_logits_within_first_order_bound(architecture: str, method: str, checkpoints: Callable[..., Path]) -> None:
    base = checkpoints(architecture)
    reference, quantized = load_model(base), load_model(base, method)
    config = quant_config(method)
    eps: dict[str, float] = {}  # relative weight error of each quantized weight, per matmul kind and layer
    unquantized = dict(reference.named_parameters())
    for name, module in quantized.named_modules():
        for param in ("weight", "w13_weight", "w2_weight"):
            scale = getattr(module, f"{param}_scale", None)
            if scale is None:
                continue
            weight = getattr(module, param)
            original = unquantized[f"{name}.{param}"]
            groups = module.quant_method.row_groups(module)
            groups = groups[param.split("_")[0]] if isinstance(groups, dict) else groups
            dequantized = config.dequantize(weight, scale, groups, torch.float32)
            eps[f"{name}.{param}"] = ((dequantized - original).norm() / original.norm()).item()
    assert len(eps) == 4 * reference.config.num_hidden_layers  # qkv, o, gate_up (w13), down (w2)
    expected, actual = logits(reference), logits(quantized)
    relative = ((actual - expected).norm() / expected.norm()).item()
    assert 0 < relative <= sum(eps.values()), (relative, eps)


# -- tensor parallelism: real gloo ranks ------------------------------------------------------------

def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equal, dtype included."""
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.reshape(-1).view(torch.uint8),
                                                                     b.reshape(-1).view(torch.uint8))


def _rank_shards(rank: int, world_size: int, architecture: str, base: Path, prequantized: dict[str, Path]
                 ) -> dict[str, Any]:
    """On one rank of a real TP group, per method: logits on the fly and pre-quantized, the parameters
    that differ between the two, those that differ from the checkpoint cut by torch.chunk, weight bytes."""
    out: dict[str, Any] = {}
    for method, path in prequantized.items():
        on_the_fly, loaded = load_model(base, method), load_model(path)
        fly_state, loaded_state = on_the_fly.state_dict(), loaded.state_dict()
        expected = expected_shards(load_file(str(path / "model.safetensors")), architecture, rank, world_size)
        out[method] = {
            "logits": logits(on_the_fly), "logits_loaded": logits(loaded), "bytes": weight_bytes(on_the_fly),
            "differ": [n for n, t in fly_state.items() if not same(t, loaded_state[n])],
            "misplaced": [n for n, t in expected.items() if not same(loaded_state[n], t)],
        }
    return out


def _colwise(tensors: list[torch.Tensor], rank: int, tp: int) -> torch.Tensor:
    return torch.cat([t.chunk(tp, dim=0)[rank] for t in tensors])


def _qkv_rows(qkv: list[torch.Tensor], rank: int, tp: int, kv_heads: int) -> torch.Tensor:
    """Rank ``rank``'s rows of q, k and v: q's chunk; k's and v's chunk, or where there are fewer KV heads than ranks,
    the one KV head this rank holds a replica of (rank * kv_heads // tp)."""
    k, v = (t.chunk(tp, dim=0)[rank] if kv_heads % tp == 0 else t.chunk(kv_heads, dim=0)[rank * kv_heads // tp]
            for t in qkv[1:])
    return torch.cat([qkv[0].chunk(tp, dim=0)[rank], k, v])


def expected_shards(checkpoint: dict[str, torch.Tensor], architecture: str, rank: int, tp: int
                    ) -> dict[str, torch.Tensor]:
    """Rank ``rank``'s layer-0 weights and scales, cut from the checkpoint with torch.chunk (gpt-fast's way)."""
    p = "model.layers.0"
    out = {}
    for suffix in ("weight", "weight_scale"):
        qkv = [checkpoint[f"{p}.self_attn.{x}_proj.{suffix}"] for x in "qkv"]
        o = checkpoint[f"{p}.self_attn.o_proj.{suffix}"]
        per_tensor = suffix == "weight_scale" and qkv[0].dim() == 0
        kv_heads = ModelRegistry.resolve_model_cls(architecture).example_config["num_key_value_heads"]
        out[f"{p}.self_attn.qkv_proj.{suffix}"] = torch.stack(qkv) if per_tensor else _qkv_rows(qkv, rank, tp, kv_heads)
        out[f"{p}.self_attn.o_proj.{suffix}"] = (o.reshape(1) if per_tensor else o if suffix == "weight_scale"
                                                 else o.chunk(tp, dim=1)[rank])
        if architecture == "MixtralForCausalLM":
            experts = range(ModelRegistry.resolve_model_cls(architecture).example_config["num_local_experts"])
            moe = f"{p}.block_sparse_moe.experts"
            w13 = [[checkpoint[f"{moe}.{e}.{w}.{suffix}"] for w in ("w1", "w3")] for e in experts]
            w2 = [checkpoint[f"{moe}.{e}.w2.{suffix}"] for e in experts]
            if per_tensor:
                out[f"{p}.mlp.experts.w13_weight_scale"] = torch.stack([torch.stack(pair) for pair in w13])
                out[f"{p}.mlp.experts.w2_weight_scale"] = torch.stack(w2).reshape(-1, 1)
            else:
                out[f"{p}.mlp.experts.w13_{suffix}"] = torch.stack([_colwise(pair, rank, tp) for pair in w13])
                out[f"{p}.mlp.experts.w2_{suffix}"] = torch.stack(
                    w2 if suffix == "weight_scale" else [w.chunk(tp, dim=1)[rank] for w in w2])
        else:
            gate_up = [checkpoint[f"{p}.mlp.{x}_proj.{suffix}"] for x in ("gate", "up")]
            down = checkpoint[f"{p}.mlp.down_proj.{suffix}"]
            out[f"{p}.mlp.gate_up_proj.{suffix}"] = torch.stack(gate_up) if per_tensor else _colwise(gate_up, rank, tp)
            out[f"{p}.mlp.down_proj.{suffix}"] = (down.reshape(1) if per_tensor else down if suffix == "weight_scale"
                                                  else down.chunk(tp, dim=1)[rank])
    return out


@pytest.mark.parametrize("architecture", ARCHS)
def test_tp2_equals_tp1(architecture: str, checkpoints: Callable[..., Path]) -> None:
    """At TP=2 (two gloo ranks): shards of weights and scales are the checkpoint's, cut as gpt-fast cuts them;
    on the fly equals pre-quantized per rank; logits equal TP=1's; the meta-device build predicts each rank's bytes."""
    base = checkpoints(architecture)
    prequantized = {method: checkpoints(architecture, method) for method in QUANTIZATION_METHODS}
    ranks = run_multirank(_rank_shards, 2, architecture, base, prequantized, timeout=120)
    for method, path in prequantized.items():
        tp1 = logits(load_model(path))
        for rank, result in enumerate(ranks):
            shards = result[method]
            assert shards["differ"] == [] and shards["misplaced"] == [], (method, rank, shards)
            torch.testing.assert_close(shards["logits"], tp1, rtol=1e-5, atol=1e-5)
            assert torch.equal(shards["logits"], shards["logits_loaded"])
            with tensor_parallel_state(rank, 2):
                assert weight_bytes(load_model(base, method, device="meta")) == shards["bytes"]


# -- bad input: each its own error -----------------------------------------------------------------

def test_unknown_method_names_the_known_ones() -> None:
    with pytest.raises(QuantizationError, match=r"quantization='awq'.*'fp8', 'fbgemm_fp8', 'int8'"):
        get_quantization_config("awq")


def test_checkpoint_method_disagreeing_with_quantization(checkpoints: Callable[..., Path]) -> None:
    hf_config = HFConfig.from_file(checkpoints("LlamaForCausalLM", "int8") / "config.json")
    with pytest.raises(QuantizationError, match=r"quantization='fp8'.*already quantized with 'int8'"):
        get_quant_config("fp8", hf_config["quantization_config"])
    assert isinstance(get_quant_config("int8", hf_config["quantization_config"]), ScaledQuantizationConfig)
    assert get_quant_config(None, None) is None


@pytest.mark.parametrize(("extra", "match"), [
    ({"activation_scheme": "static"}, r"activation_scheme='static' are not supported"),
    ({"weight_block_size": [128, 128]}, r"weight_block_size=\[128, 128\] are not supported"),
    ({"quant_method": "fbgemm_fp8"}, r"quant_method='fbgemm_fp8', not 'fp8'"),
])
def test_fp8_checkpoint_layouts_engine_ref_cannot_read(extra: dict[str, Any], match: str) -> None:
    with pytest.raises(QuantizationError, match=match):
        Fp8Config.from_config({"quant_method": "fp8", "activation_scheme": "dynamic", **extra})


def test_config_round_trips_and_ignored_layers_stay_unquantized() -> None:
    for method in QUANTIZATION_METHODS:
        config = get_quantization_config(method)(True, ["model.layers.0.self_attn.o_proj"])
        assert isinstance(config, ScaledQuantizationConfig)
        again = type(config).from_config(config.to_hf_config())
        assert again.ignored_layers == config.ignored_layers and again.is_checkpoint_serialized
        assert isinstance(config.get_quant_method(QKVParallelLinear(64, 16, 4, 2),
                                                  "model.layers.0.self_attn.o_proj"), UnquantizedLinearMethod)
        assert not isinstance(config.get_quant_method(QKVParallelLinear(64, 16, 4, 2),
                                                      "model.layers.10.self_attn.o_proj"), UnquantizedLinearMethod)


def test_layer_without_a_method_is_refused() -> None:
    with pytest.raises(QuantizationError, match=r"fp8 cannot quantize model.embed_tokens \(VocabParallelEmbedding\)"):
        Fp8Config().get_quant_method(VocabParallelEmbedding(256, 64), "model.embed_tokens")


def test_torch_without_float8(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delattr(torch, "float8_e4m3fn")
    with pytest.raises(QuantizationError, match=r"no torch.float8_e4m3fn.*quantization='int8'"):
        get_quantization_config("fp8")()


def _edited_copy(source: Path, destination: Path, edit: Callable[[dict[str, torch.Tensor]], None]) -> Path:
    shutil.copytree(source, destination)
    tensors = load_file(str(destination / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(destination / "model.safetensors"))
    return destination


SCALE = "model.layers.1.self_attn.o_proj.weight_scale"


@pytest.mark.parametrize("method", ["fp8", "int8"])
def test_missing_scale_is_named(method: str, checkpoints: Callable[..., Path], tmp_path: Path) -> None:
    model = _edited_copy(checkpoints("LlamaForCausalLM", method), tmp_path / "m", lambda t: t.pop(SCALE))
    with pytest.raises(WeightLoadError, match=rf"missing 1 tensor.*'{SCALE}'"):
        load_model(model)


@pytest.mark.parametrize(("method", "shape", "match"), [
    ("fp8", (2,), r"has shape \[2\], but a per-tensor weight_scale is a scalar"),
    ("int8", (64,), r"has shape \[64\], but the model's .* expects \[64, 1\]"),
])
def test_misshaped_scale_is_named(method: str, shape: tuple[int, ...], match: str,
                                  checkpoints: Callable[..., Path], tmp_path: Path) -> None:
    def reshape(tensors: dict[str, torch.Tensor]) -> None:
        tensors[SCALE] = torch.ones(shape)

    model = _edited_copy(checkpoints("LlamaForCausalLM", method), tmp_path / "m", reshape)
    with pytest.raises(WeightLoadError, match=match):
        load_model(model)


def test_unquantized_weights_under_a_quantized_config(checkpoints: Callable[..., Path], tmp_path: Path) -> None:
    """config.json says fp8, the weights are float32: refused, not silently cast without their scales."""
    model = tmp_path / "m"
    shutil.copytree(checkpoints("LlamaForCausalLM"), model)
    config = json.loads((model / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic"}
    (model / "config.json").write_text(json.dumps(config))
    with pytest.raises(WeightLoadError, match=r"is torch.float32, but the quantized checkpoint layout stores it as "
                                              r"torch.float8_e4m3fn"):
        load_model(model)


def test_quant_method_must_fit_the_layer() -> None:
    class Confused(QuantizationConfig):
        @classmethod
        def get_name(cls) -> str:
            return "confused"

        @classmethod
        def from_config(cls, config: dict[str, Any]) -> Confused:
            return cls()

        def get_quant_method(self, layer: torch.nn.Module, prefix: str) -> Any:
            return object()

    with pytest.raises(QuantizationError, match=r"confused gave qkv a object, which is not a LinearMethodBase"):
        QKVParallelLinear(64, 16, 4, 2, quant_config=Confused(), prefix="qkv")


# -- through the engine: LLM(quantization=...) and pre-quantized checkpoints at TP 1 and 2 ----------

ENGINE = {"device_memory": "512MiB", "max_model_len": 64, "max_num_batched_tokens": 64}
PROMPTS = [PROMPT, [7, 2, 11]]


@dataclass
class Run:
    """One engine start: greedy tokens, rank 0's prompt logits, its matmul weights (TP=1), the report."""

    tokens: list[list[int]]
    logits: list[torch.Tensor]
    weights: dict[str, torch.Tensor]
    report: StartupReport


def run_llm(model: Path, tp: int = 1, weight_names: list[str] | None = None, **kwargs: Any) -> Run:
    with LLM(str(model), tensor_parallel_size=tp, **ENGINE, **kwargs) as llm:
        tokens = llm.generate(PROMPTS, max_tokens=4, ignore_eos=True)
        logits = llm.engine.executor.collective_rpc(prompt_logits, args=(PROMPTS,))[0]
        weights = llm.engine.executor.collective_rpc(matmul_weights, args=(weight_names,))[0] if tp == 1 else {}
        return Run(tokens, logits, weights, llm.startup_report)


def assert_estimate_equals_measurement(model: Path, tp: int, report: StartupReport, **kwargs: Any) -> None:
    estimate = estimate_memory(model, tensor_parallel_size=tp, **ENGINE, **kwargs)
    comparison = compare_with_report(estimate, report)
    assert comparison.ok, comparison.describe()
    assert estimate.weight_bytes_per_rank == [w.memory.weights for w in report.workers]
    assert estimate.buffer_bytes_per_rank == [w.memory.buffers for w in report.workers]


@pytest.mark.parametrize("method", ["fp8", "int8"])
@pytest.mark.parametrize("architecture", ARCHS)
def test_engine_runs_quantized_checkpoints_at_tp1_and_tp2(architecture: str, method: str,
                                                         checkpoints: Callable[..., Path]) -> None:
    """LLM on the unquantized checkpoint with quantization=METHOD (converted at startup) and on its pre-quantized
    twin, at TP 1 and 2: the same tokens everywhere; logits equal between the two sources, within float32
    all-reduce rounding between TP sizes, and within the first-order bound (the sum of the quantized weights'
    relative errors) of the unquantized engine's; weights 1 byte per 8-bit value plus scales, estimate ==
    measurement to the byte; each rank reads only its shard."""
    base, prequantized = checkpoints(architecture), checkpoints(architecture, method)
    converted = run_llm(base, quantization=method)
    reference = run_llm(base, weight_names=sorted(converted.weights))
    runs = {("converted", 1): converted, ("prequantized", 1): run_llm(prequantized),
            ("converted", 2): run_llm(base, 2, quantization=method), ("prequantized", 2): run_llm(prequantized, 2)}
    eps = {name: relative_error(w, reference.weights[name]) for name, w in converted.weights.items()}
    assert len(eps) == 4 * HFConfig.from_file(base / "config.json")["num_hidden_layers"]  # qkv, o, gate_up, down
    tolerance = sum(eps.values())
    for (source, tp), run in runs.items():
        assert run.tokens == converted.tokens, (source, tp)
        assert run.report.tensor_parallel_size == tp
        error = relative_error(run.logits, reference.logits)
        assert 0 < error <= tolerance, (source, tp, error, tolerance)
        if tp == 1:
            assert all(torch.equal(a, b) for a, b in zip(run.logits, converted.logits, strict=True)), source
            assert run.report.workers[0].memory.weights == file_bytes(prequantized)
        else:
            for a, b in zip(run.logits, converted.logits, strict=True):
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
        reads = [w.bytes_read for w in run.report.workers]
        if source == "prequantized":  # the bytes it holds: its shards, and what every rank replicates
            assert reads == [w.memory.weights for w in run.report.workers], (tp, reads)
        else:  # the unquantized shards it converts
            assert reads == [file_bytes(base)] if tp == 1 else all(r < file_bytes(base) for r in reads), (tp, reads)
        assert_estimate_equals_measurement(base if source == "converted" else prequantized, tp, run.report,
                                           quantization=method if source == "converted" else None)


def test_dummy_weights_of_a_prequantized_config_are_quantized_on_the_fly(checkpoints: Callable[..., Path]) -> None:
    """load_format='dummy' with a pre-quantized config.json: random model-dtype weights converted at startup, so
    the parameters (and bytes) are those the checkpoint would load, with valid scales."""
    prequantized = checkpoints("MixtralForCausalLM", "int8")
    for tp in (1, 2):
        dummy = run_llm(prequantized, tp, load_format="dummy")
        assert [w.bytes_read for w in dummy.report.workers] == [0] * tp
        loaded = run_llm(prequantized, tp)
        assert [w.memory.weights for w in dummy.report.workers] == [w.memory.weights for w in loaded.report.workers]
        assert all(torch.isfinite(logits).all() for logits in dummy.logits)
        assert_estimate_equals_measurement(prequantized, tp, dummy.report)


# -- bad input through EngineArgs / LLM: each its own error ----------------------------------------

def _with_config(source: Path, destination: Path, **fields: Any) -> Path:
    shutil.copytree(source, destination)
    config = json.loads((destination / "config.json").read_text())
    config.update(fields)
    (destination / "config.json").write_text(json.dumps(config))
    return destination


def test_bad_quantization_arguments_are_refused_before_any_worker_starts(
        checkpoints: Callable[..., Path], tiny_checkpoint: Callable[..., Path], tmp_path: Path) -> None:
    llama = checkpoints("LlamaForCausalLM")
    with pytest.raises(QuantizationError, match=r"quantization='awq' is not a method engine_ref has; use one of "
                                                r"\['fp8', 'fbgemm_fp8', 'int8'\]"):
        LLM(str(llama), quantization="awq", **ENGINE)
    with pytest.raises(QuantizationError, match=r"quantization=8 must be a method name"):
        LLM(str(llama), quantization=8, **ENGINE)
    with pytest.raises(QuantizationError, match=r"quantization='fp8' was asked for, but the checkpoint is already "
                                                r"quantized with 'int8'.*pass quantization='int8' or leave it unset"):
        LLM(str(checkpoints("LlamaForCausalLM", "int8")), quantization="fp8", **ENGINE)
    llava = tiny_checkpoint("LlavaForConditionalGeneration")
    with pytest.raises(QuantizationError, match=r"quantization='int8' was asked for, but LlavaForConditionalGeneration "
                                                r"does not support quantization \(its class does not declare "
                                                r"SupportsQuant\)"):
        LLM(str(llava), quantization="int8", **ENGINE)
    quantized_llava = _with_config(llava, tmp_path / "llava", quantization_config={"quant_method": "int8"})
    with pytest.raises(QuantizationError, match=r"config.json says its weights are quantized \(int8\), but "
                                                r"LlavaForConditionalGeneration does not support quantization"):
        EngineArgs(str(quantized_llava)).create_engine_config(inspect_in_subprocess=False)
    nameless = _with_config(llama, tmp_path / "nameless", quantization_config={"bits": 8})
    with pytest.raises(QuantizationError, match=r"quantization_config \{'bits': 8\} names no quant_method"):
        LLM(str(nameless), **ENGINE)
    with pytest.raises(QuantizationError, match=r"LlavaForConditionalGeneration does not support quantization.*"
                                                r"write it unquantized"):
        make_quantized_checkpoint("LlavaForConditionalGeneration", tmp_path / "q-llava", "fp8")


def test_fp8_on_a_torch_without_float8_is_refused_at_config_time(checkpoints: Callable[..., Path],
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    llama = checkpoints("LlamaForCausalLM")
    monkeypatch.delattr(torch, "float8_e4m3fn")
    with pytest.raises(QuantizationError, match=r"no torch.float8_e4m3fn.*quantization='int8'"):
        EngineArgs(str(llama), quantization="fp8").create_engine_config(inspect_in_subprocess=False)


def test_a_rank_missing_its_scale_names_the_tensor(checkpoints: Callable[..., Path], tmp_path: Path) -> None:
    model = _edited_copy(checkpoints("Qwen2ForCausalLM", "int8"), tmp_path / "m", lambda t: t.pop(SCALE))
    with pytest.raises(WorkerStartupError, match=rf"missing 1 tensor.*'{SCALE}'"):
        LLM(str(model), tensor_parallel_size=2, **ENGINE)


# -- the command line --------------------------------------------------------------------------------

CLI_ENGINE = ["--max-model-len", "64", "--max-num-batched-tokens", "64", "--device-memory", "512MiB"]


def test_cli_writes_a_sharded_prequantized_checkpoint_that_starts_and_estimates_to_the_byte(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    model = tmp_path / "llama-int8"
    assert main(["make-checkpoint", "LlamaForCausalLM", str(model), "--quantization", "int8", "--num-shards", "2"]) == 0
    assert capsys.readouterr().out == f"wrote LlamaForCausalLM int8 checkpoint to {model}\n"
    weight_map = json.loads((model / "model.safetensors.index.json").read_text())["weight_map"]
    assert sorted(set(weight_map.values())) == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    assert weight_map[SCALE] == weight_map[SCALE.removesuffix("_scale")]  # a scale sits beside its weight
    assert json.loads((model / "config.json").read_text())["quantization_config"]["quant_method"] == "int8"

    assert main(["startup", str(model), "-tp", "2", "--json", *CLI_ENGINE]) == 0
    report = json.loads(capsys.readouterr().out)
    assert main(["estimate", str(model), "-tp", "2", "--json", *CLI_ENGINE]) == 0
    estimate = json.loads(capsys.readouterr().out)
    assert estimate["weight_bytes_per_rank"] == [w["memory"]["weights"] for w in report["workers"]]
    assert [w["bytes_read"] for w in report["workers"]] == estimate["weight_bytes_per_rank"]
    # --quantization on the unquantized checkpoint: the same bytes, converted at startup.
    assert main(["make-checkpoint", "LlamaForCausalLM", str(tmp_path / "llama"), "--num-shards", "2"]) == 0
    capsys.readouterr()
    assert main(["estimate", str(tmp_path / "llama"), "-tp", "2", "--json", "-q", "int8", *CLI_ENGINE]) == 0
    assert json.loads(capsys.readouterr().out)["weight_bytes_per_rank"] == estimate["weight_bytes_per_rank"]


@pytest.mark.parametrize(("argv", "message"), [
    (["startup", "LlamaForCausalLM", "--quantization", "awq"], r"quantization='awq' is not a method engine_ref has"),
    (["startup", "LlavaForConditionalGeneration", "-q", "int8"],
     r"LlavaForConditionalGeneration does not support quantization"),
    (["make-checkpoint", "LlavaForConditionalGeneration", "{tmp}/x", "-q", "fp8"],
     r"LlavaForConditionalGeneration does not support quantization.*write it unquantized"),
    (["make-checkpoint", "LlamaForCausalLM", "{tmp}/x", "-q", "gptq"], r"quantization='gptq' is not a method"),
    (["estimate", "{llava_config}", "--device-memory", "16GiB", "-q", "fp8"],
     r"LlavaForConditionalGeneration does not support quantization"),
])
def test_cli_quantization_errors_exit_2_in_one_line(argv: list[str], message: str, tmp_path: Path,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    llava_config = REFERENCE_CONFIGS_DIR / "llava-1.5-7b-hf.json"
    argv = [a.format(tmp=tmp_path, llava_config=llava_config) for a in argv]
    assert main([*argv, *(CLI_ENGINE if argv[0] == "startup" else [])]) == 2
    err = capsys.readouterr().err
    assert err.startswith("engine-ref: error: ") and err.count("\n") == 1, err
    assert re.search(message, err), err


def test_llama_3_8b_fp8_fits_a_16gib_device_at_tp1_and_unquantized_does_not(capsys: pytest.CaptureFixture[str]
                                                                             ) -> None:
    """The estimate.py docstring's example: fp8 keeps each linear weight in 1 byte (224 per-tensor scales of 4 B),
    the embedding and LM head in bfloat16; that leaves room for KV cache in 0.9 x 16 GiB, bfloat16 does not."""
    path = REFERENCE_CONFIGS_DIR / "Meta-Llama-3-8B.json"
    c = json.loads(path.read_text())
    h, i, layers, vocab = c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"], c["vocab_size"]
    kv = c["num_key_value_heads"] * h // c["num_attention_heads"]
    linear = layers * (2 * h * h + 2 * h * kv + 3 * h * i)  # q, o; k, v; gate, up, down
    bf16 = 2 * (2 * vocab * h + (2 * layers + 1) * h)  # embedding, LM head, norms
    assert main(["estimate", str(path), "--device-memory", "16GiB", "--quantization", "fp8", "--json"]) == 0
    fp8 = json.loads(capsys.readouterr().out)
    assert fp8["weight_bytes_per_rank"] == [linear + bf16 + 7 * layers * 4]
    assert fp8["fits"] and fp8["max_concurrency"] > 1 and fp8["max_model_len_estimate"] == c["max_position_embeddings"]
    assert main(["estimate", str(path), "--device-memory", "16GiB", "--json"]) == 1
    unquantized = json.loads(capsys.readouterr().out)
    assert unquantized["weight_bytes_per_rank"] == [2 * linear + bf16] and not unquantized["fits"]
    assert unquantized["reason"].startswith("the weights of rank 0")
    assert unquantized["weight_bytes_per_rank"][0] > 0.9 * 16 * 2**30 > fp8["weight_bytes_per_rank"][0]
