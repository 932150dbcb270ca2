"""Tiny checkpoints written from vLLM's side (targets/vllm/vllm_weights.py) for architectures transformers has no
class for: vLLM's engine loads them and runs ``load[tp=1]``; a written tensor the model does not consume is a
NoTinyCheckpoint naming it (a config only remote code defines: test_vllm_remote_config.py)."""

from __future__ import annotations

from typing import Any

import pytest

from tests.vllm.load_check import load_tp1

# Configs of vLLM's own config registry (ChatGLM, Step3p5) and one transformers names otherwise (PhiMoE: phimoe);
# dense, MoE with per-expert checkpoint tensors, fused QKV.
NATIVE = ["ChatGLMModel", "PhiMoEForCausalLM", "Step3p5ForCausalLM"]
# A name vLLM's AutoWeightsLoader skips without a word (rotary caches some checkpoints carry): written, never consumed.
UNCONSUMED = "transformer.encoder.layers.0.self_attention.rotary_emb.inv_freq"


@pytest.mark.parametrize("architecture", NATIVE)
def test_load_tp1_runs_vllms_engine_on_a_checkpoint_written_from_vllms_side(in_child: Any, tmp_path: Any,
                                                                            architecture: str) -> None:
    import json

    from pytest_enginecheck.targets.vllm.checkpoints.tiny import CHECKPOINTS_DIR

    detail = in_child(load_tp1, str(tmp_path), architecture)
    assert isinstance(detail, dict), detail
    assert detail["tensor_parallel_size"] == 1 and len(detail["tokens"]) == 3
    assert all(len(tokens) > 0 for tokens in detail["tokens"])
    config = json.loads((tmp_path / CHECKPOINTS_DIR / architecture / "config.json").read_text())
    assert config["architectures"] == [architecture] and config["model_type"]
    assert config["hidden_size"] == 64 and config["vocab_size"] == 256


def _round_trip(workdir: str) -> tuple[str, str, str]:
    """Make ChatGLM's checkpoint twice (checksums), prove it, add a tensor no parameter takes and prove it again."""
    import hashlib
    import os
    from pathlib import Path

    import torch
    from safetensors.torch import load_file, save_file

    from pytest_enginecheck.targets.vllm.checkpoints.shrink import NoTinyCheckpoint
    from pytest_enginecheck.targets.vllm.checkpoints.tiny import make_tiny_checkpoint
    from pytest_enginecheck.targets.vllm.checkpoints.weight_layout import WEIGHTS_FILE, prove_round_trip

    os.environ["VLLM_PLUGINS"] = "clean"
    paths = [make_tiny_checkpoint("ChatGLMModel", Path(workdir) / run) for run in ("a", "b")]
    sums = [hashlib.sha256((p / WEIGHTS_FILE).read_bytes()).hexdigest() for p in paths]
    prove_round_trip(paths[0])  # as written: every tensor consumed, every parameter loaded
    tensors = load_file(str(paths[0] / WEIGHTS_FILE))
    tensors[UNCONSUMED] = torch.ones(16)
    save_file(tensors, str(paths[0] / WEIGHTS_FILE))
    try:
        prove_round_trip(paths[0])
    except NoTinyCheckpoint as e:
        return sums[0], sums[1], str(e)
    return sums[0], sums[1], "the round trip passed"


def test_the_round_trip_names_a_written_tensor_the_model_does_not_consume(in_child: Any, tmp_path: Any) -> None:
    first, second, message = in_child(_round_trip, str(tmp_path))
    assert first == second  # checkpoints.SEED: the same weights every time
    assert "tensors written but not consumed: " + UNCONSUMED in message, message
    assert "parameters not (wholly) loaded" not in message, message


# Checkpoints vLLM's loader takes under other names than its parameters': Step3Text's experts stacked, one tensor per
# projection (``moe.gate_proj.weight`` of every expert), IQuestLoopCoder's gate projections one module shorter
# (``gate_projections.0.weight`` for the parameter ``gate_projections.0.gate_proj.weight``). load[tp=1] of both runs
# with the engine checks and passes; here that the checkpoint is made with those names and round-trips.
RENAMED = {"Step3TextForCausalLM": ("model.layers.1.moe.gate_proj.weight", 4),
           "IQuestLoopCoderForCausalLM": ("model.gate_projections.1.weight", 2)}


def _written(workdir: str, architecture: str) -> dict[str, tuple[int, ...]]:
    import os
    from pathlib import Path

    from safetensors import safe_open

    from pytest_enginecheck.targets.vllm.checkpoints.tiny import make_tiny_checkpoint
    from pytest_enginecheck.targets.vllm.checkpoints.weight_layout import WEIGHTS_FILE, prove_round_trip

    os.environ["VLLM_PLUGINS"] = "clean"
    path = make_tiny_checkpoint(architecture, Path(workdir) / architecture)
    prove_round_trip(path)
    with safe_open(str(path / WEIGHTS_FILE), "pt") as f:
        return {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}  # noqa: SIM118 - safe_open's API


@pytest.mark.parametrize("architecture", RENAMED)
def test_a_checkpoint_is_written_under_the_names_vllms_loader_takes(in_child: Any, tmp_path: Any,
                                                                   architecture: str) -> None:
    name, first_dim = RENAMED[architecture]
    shapes = in_child(_written, str(tmp_path), architecture)
    assert shapes.get(name, (None,))[0] == first_dim, sorted(shapes)
    assert not any(".experts.0." in n or ".gate_proj.gate_proj." in n or "gate_projections.0.gate_proj" in n
                   for n in shapes), sorted(shapes)


# Architectures whose tiny checkpoint needed a family rule of the shrink (checkpoints.py), with a field of the written
# config.json that shows the rule: GLM-4.5's hub ``head_dim`` that transformers' Glm4MoeConfig dropped (HUB_SCHEMA),
# GPT-J's ``rotary_dim`` in its share of the tiny head (vLLM's RoPE refused 64 of a 32 head), Lfm2-MoE's dense layers
# leaving a MoE layer (vLLM's lfm2_moe.py raised finding none), TeleFLM's muP fields (a LlamaForCausalLM whose config
# is not Llama's: the checker's remote config, checkpoints.foreign_base), SarvamMLA's hub head_dim, its MLA head (vLLM's
# MLA metadata refused the tiny 32; its MLA layers make it run in bfloat16: engine.builds_mla), Isaac's top-level
# head_dim, its text decoder's (TINY_SIZES' 64; its M-RoPE sections of the full-size 128 failed vLLM's rotary
# assertion).
FAMILY_RULES = {"Glm4MoeForCausalLM": ("head_dim", 32), "GPTJForCausalLM": ("rotary_dim", 8),
                "Lfm2MoeForCausalLM": ("num_dense_layers", 1), "TeleFLMForCausalLM": ("use_mup", True),
                "SarvamMLAForCausalLM": ("head_dim", 576), "IsaacForConditionalGeneration": ("head_dim", 64)}
DTYPES = {"SarvamMLAForCausalLM": "bfloat16"}  # the dtype load runs in, where not float32


@pytest.mark.parametrize("architecture", FAMILY_RULES)
def test_load_tp1_passes_on_the_tiny_checkpoint_of_a_family_rule(in_child: Any, tmp_path: Any,
                                                                 architecture: str) -> None:
    import json

    from pytest_enginecheck.targets.vllm.checkpoints.tiny import CHECKPOINTS_DIR

    detail = in_child(load_tp1, str(tmp_path), architecture, timeout=480.0)
    assert isinstance(detail, dict), detail
    assert detail["tensor_parallel_size"] == 1 and all(len(tokens) > 0 for tokens in detail["tokens"])
    assert detail["dtype"] == DTYPES.get(architecture, "float32")
    field, value = FAMILY_RULES[architecture]
    config = json.loads((tmp_path / CHECKPOINTS_DIR / architecture / "config.json").read_text())
    assert config[field] == value, config
