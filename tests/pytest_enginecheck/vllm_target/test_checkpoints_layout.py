"""A written tiny checkpoint as vLLM reads it, without vLLM: the hub's names, norms and fields repaired where
transformers' writer differs (hub_layout, multimodal), a packed layer's shards (weight_layout), the vocabulary
read back (reading), and the transformers classes the writer cannot use (from_transformers)."""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path
from typing import Any

import pytest

# --- hub_layout: what transformers' writer wrote, brought to the hub checkpoints' names and fields ----------------

def test_hub_fields_give_the_hub_names_vllm_reads_from_what_transformers_wrote() -> None:
    from pytest_enginecheck.targets.vllm.checkpoints.hub_layout import hub_fields

    glm = {"model_type": "glm4_moe", "hidden_size": 64, "num_attention_heads": 2, "partial_rotary_factor": 0.5}
    assert hub_fields(glm) == {"head_dim": 32}
    hy = hub_fields({"model_type": "hy_v3", "moe_intermediate_size": 64, "mlp_layer_types": ["dense", "sparse"]})
    assert hy["expert_hidden_dim"] == 64 and hy["first_k_dense_replace"] == 1 and hy["qk_norm"] is True
    minimax = {"model_type": "minimax_m2", "head_dim": 32, "rope_parameters": {"partial_rotary_factor": 0.5}}
    assert hub_fields(minimax)["rotary_dim"] == 16
    assert hub_fields({"model_type": "lfm2", "hidden_size": 64}) == {"block_dim": 64, "conv_dim": 64}
    assert hub_fields({"model_type": "llama", "hidden_size": 64}) == {}


def test_what_transformers_writer_gets_wrong_is_repaired_by_name() -> None:
    from pytest_enginecheck.targets.vllm.checkpoints.hub_layout import written_name, zero_expert_tensors

    assert written_name("model.layers.1.hc_pre.hc_mlp_layer.hc_base", "hy_v4") == \
        "model.layers.1.hc_mlp_layer.hc_pre.hc_base"
    assert written_name("model.hc_pre.hc_head.hc_head_scale", "hy_v4") == "model.hc_head.hc_head_scale"
    assert written_name("model.hc_pre.hc_head.hc_head_scale", "llama") == "model.hc_pre.hc_head.hc_head_scale"
    names = ["model.layers.0.mlp.experts.3.gate_proj.weight", "model.layers.0.mlp.experts.4.up_proj.weight",
             "model.layers.0.mlp.experts.12.gate_proj.weight", "model.layers.0.mlp.router.classifier.weight"]
    assert zero_expert_tensors(names, 4) == names[1:3]


def test_a_norm_the_hub_has_in_every_layer_is_added_where_transformers_wrote_none(tmp_path: Path) -> None:
    import torch
    from safetensors.torch import load_file, save_file

    from pytest_enginecheck.targets.vllm.checkpoints.hub_layout import add_hub_norms

    moe_norm = "model.layers.1.post_mlp_layernorm.weight"  # transformers' AXK1 writes the MoE layer's only
    save_file({moe_norm: torch.full((64,), 2.0)}, str(tmp_path / "model.safetensors"))
    saved = {"model_type": "axk1", "hidden_size": 64, "num_hidden_layers": 2, "first_k_dense_replace": 1}
    assert add_hub_norms(tmp_path, saved) == ["model.layers.0.post_mlp_layernorm.weight"]
    tensors = load_file(str(tmp_path / "model.safetensors"))
    assert torch.equal(tensors["model.layers.0.post_mlp_layernorm.weight"], torch.ones(64))
    assert torch.equal(tensors[moe_norm], torch.full((64,), 2.0))  # what transformers wrote is kept
    assert add_hub_norms(tmp_path, saved) == [] and add_hub_norms(tmp_path, {**saved, "model_type": "llama"}) == []


def test_sarvams_head_dim_is_its_mla_head_as_on_the_hub() -> None:
    from pytest_enginecheck.targets.vllm.checkpoints.hub_layout import hub_fields

    sarvam = {"model_type": "sarvam_mla", "kv_lora_rank": 512, "qk_rope_head_dim": 64, "hidden_size": 64}
    assert hub_fields(sarvam) == {"head_dim": 576}  # one of the head sizes vLLM's MLA metadata accepts


def test_isaacs_top_level_head_dim_is_its_text_decoders() -> None:
    from types import SimpleNamespace

    from pytest_enginecheck.targets.vllm.checkpoints.multimodal import _hub_layout

    text = SimpleNamespace(head_dim=32)

    class Isaac:
        head_dim = 128  # IsaacConfig's copy of the full-size decoder's fields at its top level

        def to_json_string(self, use_diff: bool = True) -> str:
            return json.dumps({"model_type": "isaac", "head_dim": self.head_dim, "text_config": {"head_dim": 32}})

        def get_text_config(self) -> SimpleNamespace:
            return text

    saved = _hub_layout("IsaacForConditionalGeneration", "isaac", Isaac())
    # Isaac's M-RoPE sections [head_dim // 4, head_dim // 8, head_dim // 8] add up to half the text decoder's head
    assert saved["head_dim"] == 32
    assert sum([saved["head_dim"] // 4, saved["head_dim"] // 8, saved["head_dim"] // 8]) == text.head_dim // 2


# --- weight_layout: a packed layer's shards, as the model's mapper names them ---------------------------------------

def test_a_stacking_mapper_names_the_shards_of_a_packed_layer_in_shard_order() -> None:
    from types import SimpleNamespace

    from pytest_enginecheck.targets.vllm.checkpoints.weight_layout import stacked_shards

    # TeleChat2Model's mapper (on the inner model, not the outer one): the hub's query/key/value, gate/up projections
    mapper = SimpleNamespace(orig_to_new_stacked={".value": (".qkv_proj", "v"), ".query": (".qkv_proj", "q"),
                                                  ".key": (".qkv_proj", "k"), ".up_proj": (".gate_up_proj", 1),
                                                  ".gate_proj": (".gate_up_proj", 0)})
    inner, outer = SimpleNamespace(hf_to_vllm_mapper=mapper), SimpleNamespace(hf_to_vllm_mapper=None)
    model = SimpleNamespace(modules=lambda: iter([outer, inner]))
    assert stacked_shards(model) == {"qkv_proj": ["query", "key", "value"], "gate_up_proj": ["gate_proj", "up_proj"]}


# --- reading.vocab_size: the prompts' vocabulary, wherever the text decoder's config.json keeps it ----------------


@pytest.mark.parametrize("config, expected", [
    ({"vocab_size": 256, "text_config": {"vocab_size": 512}}, 256),  # a text decoder's own
    ({"text_config": {"vocab_size": 256}, "vision_config": {"hidden_size": 64}}, 256),  # Llava's
    ({"llm_config": {"vocab_size": 256}, "vit_config": {"vocab_size": 1024}}, 256),  # BagelConfig's: the smallest
    ({"config": {"text": {"vocab_size": 256}}}, 256),  # any depth (Moondream3's config.text)
])
def test_vocab_size_is_the_text_decoders_wherever_the_config_keeps_it(tmp_path: Path, config: dict[str, Any],
                                                                        expected: int) -> None:
    from pytest_enginecheck.targets.vllm.checkpoints.reading import vocab_size

    (tmp_path / "config.json").write_text(json.dumps(config))
    assert vocab_size(str(tmp_path)) == expected


# --- from_transformers: the config transformers moved a field out of, a base class of another config ---------

def test_dbrx_gets_the_hub_attention_rope_theta_that_transformers_moved() -> None:
    from pytest_enginecheck.targets.vllm.checkpoints.from_transformers import tiny_config

    config = tiny_config("DbrxForCausalLM")
    assert config.attn_config.rope_theta == config.rope_parameters["rope_theta"]
    assert json.loads(config.to_json_string())["attn_config"]["rope_theta"] == config.rope_parameters["rope_theta"]


FOREIGN_BASE = '''\
class BaseConfig:
    def __init__(self):
        self.hidden_size = 64


class LlamaLike:
    config_class = BaseConfig

    def __init__(self, config):
        self.width = config.hidden_size
        self.window = config.sliding_window  # the base's own module: read where its config has it
'''
FOREIGN_CHILD = '''\
from enginecheck_foreign_base import LlamaLike


class TeleLike(LlamaLike):
    def __init__(self, config):
        super().__init__(config)
        self.heads = config.n_head
'''


def test_a_base_class_whose_config_lacks_what_the_subclass_reads_is_foreign(tmp_path: Path) -> None:
    from pytest_enginecheck.targets.vllm.checkpoints.from_transformers import foreign_base

    (tmp_path / "enginecheck_foreign_base.py").write_text(FOREIGN_BASE)
    (tmp_path / "enginecheck_foreign_child.py").write_text(FOREIGN_CHILD)
    (tmp_path / "enginecheck_foreign_plain.py").write_text(
        "from enginecheck_foreign_base import LlamaLike\n\n\nclass Plain(LlamaLike):\n    pass\n")
    sys.path.insert(0, str(tmp_path))
    try:
        child = importlib.import_module("enginecheck_foreign_child")
        base = importlib.import_module("enginecheck_foreign_base")
        plain = importlib.import_module("enginecheck_foreign_plain")
        reason = foreign_base("TeleLike", child.TeleLike, base.LlamaLike)
        assert "reads the config field n_head, which BaseConfig of its base class LlamaLike has not" in reason
        assert "sliding_window" not in reason  # read by the base's own module
        assert foreign_base("Plain", plain.Plain, base.LlamaLike) == ""  # reads nothing beyond the base's
        assert foreign_base("LlamaLike", base.LlamaLike, base.LlamaLike) == ""  # transformers' own class
    finally:
        sys.path.remove(str(tmp_path))
        for name in ("enginecheck_foreign_base", "enginecheck_foreign_child", "enginecheck_foreign_plain"):
            sys.modules.pop(name, None)
