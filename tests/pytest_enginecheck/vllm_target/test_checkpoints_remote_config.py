"""checkpoints.remote_config without vLLM: the config fields a vLLM model's source reads, the values they get
(layouts, MLA and lightning-attention sizes) and the configuration module the checker writes."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest

from tests.pytest_enginecheck.vllm_target.helpers import _load_file

# --- remote_config: the config fields a vLLM model's source reads, their values, the config module it writes ----

MODEL_SOURCE = '''\
class DecoderLayer:
    def __init__(self, config, prefix=""):
        self.hidden_size = config.hidden_size
        self.eps = getattr(config, "rms_norm_eps")
        self.window = getattr(config, "sliding_window", None)
        self.rotary = getattr(config, "partial_rotary_factor", 0.5)
        self.theta = getattr(config, "rope_theta", 10000.0)
        if hasattr(config, "kv_lora_rank"):
            self.rank = config.kv_lora_rank
        if getattr(config, "num_experts", 0):
            self.experts = config.num_experts
        self.text = config.get_text_config()


class Model:
    def __init__(self, vllm_config):
        hf_config = vllm_config.model_config.hf_config
        self.layers = hf_config.num_hidden_layers
        self.theta = hf_config.rope_theta
        self.quant = vllm_config.quant_config.weight_block_size

    def tie(self):
        return self.config.tie_word_embeddings
'''


def test_config_reads_tells_fields_that_need_a_value_from_those_read_with_a_default() -> None:
    from pytest_enginecheck.targets.vllm.checkpoints.remote_config import config_reads

    reads = config_reads(MODEL_SOURCE)
    # rope_theta: read with a default once and plainly once, so it needs a value; a method (get_text_config) and
    # another config's field (quant_config.weight_block_size) are no fields
    assert reads.required == {"hidden_size", "rms_norm_eps", "num_hidden_layers", "rope_theta", "tie_word_embeddings"}
    assert reads.optional == {"partial_rotary_factor"}
    # the model has a path without them (hasattr; a default that says off: None, 0), read plainly or not
    assert reads.off == {"kv_lora_rank", "sliding_window", "num_experts"}


def test_field_values_give_sizes_and_llama_defaults_and_name_a_field_no_rule_knows() -> None:
    from pytest_enginecheck.targets.vllm.checkpoints.remote_config import ConfigReads, config_reads, field_values
    from pytest_enginecheck.targets.vllm.checkpoints.shrink import TINY_SIZES, NoTinyCheckpoint

    values = field_values("EctpModel", config_reads(MODEL_SOURCE))
    assert values["hidden_size"] == TINY_SIZES["hidden_size"] and values["num_hidden_layers"] == 2
    assert values["rms_norm_eps"] == 1e-6 and values["tie_word_embeddings"] is False
    assert values["vocab_size"] == TINY_SIZES["vocab_size"]  # vLLM's engine reads it of every config
    assert values["partial_rotary_factor"] == 1.0  # optional: a rule's value where one knows it
    # off: a rule's value where one knows it (no rule gives an MLA rank a model need not have), none in the second try
    assert values["num_experts"] == TINY_SIZES["num_experts"] and "kv_lora_rank" not in values
    without_off = field_values("EctpModel", config_reads(MODEL_SOURCE), leave_off=True)
    assert values.keys() - without_off.keys() == {"num_experts", "sliding_window"}
    with pytest.raises(NoTinyCheckpoint, match=r"EctpModel reads the config field ectp_window_pattern, which no rule"):
        field_values("EctpModel", ConfigReads(frozenset({"hidden_size", "ectp_window_pattern"}), frozenset()))


def test_the_remote_config_module_defines_the_model_type_and_its_defaults(tmp_path: Path) -> None:
    from pytest_enginecheck.targets.vllm.checkpoints.remote_config import (
        AUTO_MAP,
        CLASS_NAME,
        MODULE_FILE,
        RemoteConfig,
        engine_args,
    )

    remote = RemoteConfig("EctpForCausalLM", "ectp", {"hidden_size": 64, "rope_parameters": {"rope_theta": 1.0}})
    remote.write(tmp_path)
    module = _load_file(tmp_path / MODULE_FILE, "ectp_configuration_enginecheck")
    config = getattr(module, CLASS_NAME)(hidden_size=32)
    assert config.model_type == "ectp" and config.hidden_size == 32
    assert getattr(module, CLASS_NAME)().rope_parameters["rope_theta"] == 1.0
    assert remote.config().auto_map == AUTO_MAP and remote.config().architectures == ["EctpForCausalLM"]
    assert engine_args(tmp_path) == {}  # no config.json naming it yet
    (tmp_path / "config.json").write_text(json.dumps({"auto_map": AUTO_MAP}))
    assert engine_args(tmp_path) == {"trust_remote_code": True}


def test_layout_fields_follow_the_tiny_layers_as_the_model_uses_them() -> None:
    from pytest_enginecheck.targets.vllm.checkpoints.remote_config import (
        SLIDING_WINDOW,
        ConfigReads,
        field_values,
        layout_values,
    )

    fields = frozenset({"layer_group_size", "bskcn_1", "bskcn_3", "interleaved_sliding_window"})
    values = layout_values(4, ["sliding_attention", "full_attention"] * 2, fields)
    # Bailing: one group of all the layers (its last full attention); Solar: save from layer 1 (layer 0 has no
    # residual), mix back in at the last; Plamo3: a window where a layer slides, None where it attends fully
    assert values == {"layer_group_size": 4, "bskcn_1": [1], "bskcn_3": [3],
                      "interleaved_sliding_window": [SLIDING_WINDOW, None, SLIDING_WINDOW, None]}
    reads = ConfigReads(frozenset({"hidden_size", "layer_types", "interleaved_sliding_window", "bskcn_4"}), frozenset())
    solar_plamo = field_values("EctpModel", reads)
    assert solar_plamo["layer_types"] == ["full_attention"] * 2 and solar_plamo["bskcn_4"] == [1]
    assert solar_plamo["interleaved_sliding_window"] == [None, None]


def test_a_record_field_reads_by_attribute_and_writes_as_json(tmp_path: Path) -> None:
    from pytest_enginecheck.targets.vllm.checkpoints.remote_config import (
        CLASS_NAME,
        DECI_BLOCK,
        MODULE_FILE,
        RemoteConfig,
    )

    remote = RemoteConfig("DeciLMForCausalLM", "nemotron-nas", {"hidden_size": 64, "block_configs": [DECI_BLOCK] * 2,
                                                                 "rope_parameters": {"rope_theta": 1.0}})
    remote.write(tmp_path)
    config = getattr(_load_file(tmp_path / MODULE_FILE, "ectp_deci_configuration"), CLASS_NAME)()
    block = config.block_configs[1]  # as DeciLM's BlockConfig dataclasses: block_config.attention.no_op
    assert block.attention.no_op is False and block.ffn.intermediate_size == 128
    assert not hasattr(block.ffn, "ffn_mult")  # vLLM's nemotron_nas.py takes intermediate_size where it is absent
    assert json.loads(config.to_json_string())["block_configs"][0] == DECI_BLOCK
    assert type(config.rope_parameters) is dict  # a field not a record stays a plain value


def test_an_attribute_map_the_model_sets_makes_its_targets_reads() -> None:
    from pytest_enginecheck.targets.vllm.checkpoints.remote_config import config_reads

    source = textwrap.dedent('''
        def build(vllm_config):
            vllm_config.model_config.hf_config.attribute_map = {"num_hidden_layers": "n_layer", "rms_norm_eps": 1}
            return vllm_config.model_config.hf_config
        ''')
    assert config_reads(source).required == frozenset({"n_layer"})


# --- the tiny configs of models vLLM builds with MLA attention, and of Bailing's lightning attention ---

def test_mla_sizes_read_with_a_default_are_written_and_an_mla_test_or_off_default_is_not() -> None:
    from pytest_enginecheck.targets.vllm.checkpoints.remote_config import (
        MLA_FIELDS,
        ConfigReads,
        _mla_sizes,
        field_values,
    )

    # Bailing V2.5/V3: getattr(config, "kv_lora_rank", 512) and the other MLA sizes with defaults; q_lora_rank None
    reads = ConfigReads(frozenset({"hidden_size"}), frozenset({"kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
                                                                "v_head_dim"}), frozenset({"q_lora_rank"}))
    values = field_values("EctpModel", reads)
    mla = _mla_sizes()
    assert {f: values[f] for f in MLA_FIELDS if f in values} == {f: mla[f] for f in MLA_FIELDS if f != "q_lora_rank"}
    assert "q_lora_rank" not in values  # an "off" default: the path without the query's LoRA
    # openPangu: MLA sizes only tested with hasattr, a model that has a path without them: none written
    pangu = field_values("EctpModel", ConfigReads(frozenset({"hidden_size"}), frozenset(), frozenset(MLA_FIELDS)))
    assert not set(MLA_FIELDS) & pangu.keys()


def test_lightning_attention_gets_a_head_its_blocks_divide_and_bailing_v3_is_bailing_hybrid() -> None:
    from types import SimpleNamespace

    from pytest_enginecheck.targets.vllm.checkpoints.remote_config import (
        LIGHTNING_HEAD_DIM,
        ConfigReads,
        field_values,
        remote_model_type,
    )
    from pytest_enginecheck.targets.vllm.checkpoints.shrink import TINY_SIZES

    reads = ConfigReads(frozenset({"hidden_size", "head_dim"}), frozenset())
    assert field_values("BailingMoeV2_5ForCausalLM", reads)["head_dim"] == LIGHTNING_HEAD_DIM
    assert LIGHTNING_HEAD_DIM % 64 == 0  # lightning_attn.py's blocks of a head under 128
    assert field_values("BailingMoeV3ForCausalLM", reads)["head_dim"] == TINY_SIZES["head_dim"]  # KDA: no blocks
    module = SimpleNamespace(__module__="vllm.model_executor.models.bailing_moe_v3")
    for architecture in ("BailingMoeV2_5ForCausalLM", "BailingMoeV3ForCausalLM"):
        # a model type vLLM's convertor counts among its MLA types (with kv_lora_rank set)
        assert remote_model_type(architecture, module, {}) == "bailing_hybrid"  # type: ignore[arg-type]
