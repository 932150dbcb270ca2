"""Tiny configs for the architectures whose config class only remote code defines (the hub checkpoint's
``configuration_<type>.py``, named by ``auto_map``; vLLM opens it with ``trust_remote_code=True``).

The fields: those vLLM's model reads from its config, found in the source of the model class's modules (the class
and its nn.Module bases', ``vllm_weights._model_modules``): ``config.X``, ``self.config.X``, ``hf_config.X`` and
``getattr(config, "X")`` need a value; ``getattr(config, "X", default)`` and ``hasattr(config, "X")`` do not
(``config_reads``).

The values, by rules (``field_values``): a size from the shrink tables (``checkpoints.TINY_SIZES``, then
``vllm_weights.VLLM_CONFIG_SIZES``, then ``composite.ENCODER_SIZES`` for the names only encoders use elsewhere), else
a default a Llama-like config has (``LLAMA_DEFAULTS``). A field no rule knows is NoTinyCheckpoint naming it and the
architecture: the checker's limit, never a guessed value that makes the model fail.

The checkpoint then carries ``configuration_enginecheck.py`` (a PretrainedConfig subclass of that ``model_type``
whose defaults are those values, ``config_module``) and ``auto_map`` in config.json, and vLLM is started on it with
``trust_remote_code=True`` (``engine_args``), as on the hub checkpoint.
"""

from __future__ import annotations

import ast
import inspect
import json
import textwrap
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pytest_enginecheck.targets.vllm.checkpoints.config_dtype import set_float32
from pytest_enginecheck.targets.vllm.checkpoints.shrink import (
    TINY_SIZES,
    NoTinyCheckpoint,
)

MODULE_FILE = "configuration_enginecheck.py"
CLASS_NAME = "EnginecheckConfig"
AUTO_MAP = {"AutoConfig": f"{MODULE_FILE.removesuffix('.py')}.{CLASS_NAME}"}
# Names whose attributes are reads of the model's config (``self.config`` is matched besides them).
CONFIG_NAMES = frozenset({"config", "hf_config"})
VLLM_MODULES = "vllm.model_executor."  # where vLLM's models and layers are
ROPE_THETA = 10000.0
# What a Llama-like config has, for the fields the model reads that are no size: norms, activation, RoPE, biases,
# tying, and the MoE routing fields (every layer after the first MoE, one group, one shared expert).
LLAMA_DEFAULTS: dict[str, Any] = {
    "rms_norm_eps": 1e-6, "layer_norm_eps": 1e-5, "layer_norm_epsilon": 1e-5, "norm_eps": 1e-6,
    "hidden_act": "silu", "hidden_activation": "silu", "activation_function": "silu",
    "rope_theta": ROPE_THETA, "rope_parameters": {"rope_type": "default", "rope_theta": ROPE_THETA},
    "rope_scaling": None, "partial_rotary_factor": 1.0,
    "attention_bias": False, "bias": False, "mlp_bias": False, "use_bias": False, "use_qkv_bias": False,
    "qkv_bias": False, "tie_word_embeddings": False, "initializer_range": 0.02, "use_cache": True,
    "attention_dropout": 0.0, "hidden_dropout": 0.0,
    "first_k_dense_replace": 1, "moe_layer_freq": 1, "n_group": 1, "topk_group": 1, "norm_topk_prob": True,
    "num_shared_experts": 1, "n_shared_experts": 1, "n_routed_experts": 4, "routed_scaling_factor": 1.0,
    "scoring_func": "softmax", "topk_method": "greedy", "moe_router_enable_expert_bias": False,
    "use_qk_norm": False, "qk_layernorm": False, "embedding_dropout": 0.0, "is_causal": True,
    "router_enable_expert_bias": False,
    # MiniCPM's muP scales at what makes them no-ops (a Llama): embeddings x1, residuals x1, logits x hidden / base
    "scale_emb": 1.0, "scale_depth": 1.0, "dim_model_base": TINY_SIZES["hidden_size"],
    # K2Horizon's names of the MoE fields above (every layer MoE, softmax routing, no gate bias, no QK norm), its norms
    # one group (an RMSNorm), its attention output gated by silu (one of the two gates its attention has), and its
    # MoVA value experts off: they run a Triton kernel (fused_mova_impl), which vLLM's CPU backend lacks
    "decoder_sparse_step": 1, "router_score_func": "softmax", "router_scaling_factor": 1.0, "moe_gate_bias": False,
    "query_key_norm": False, "layernorm_num_groups": 1, "attention_gate_func": "silu", "mova_num_experts": 0,
    "mova_num_experts_per_tok": 2,
    # Plamo3's RoPE of its sliding-window layers; Bailing V3's short convolution of its KDA layers (Kimi Linear's 4);
    # Solar's skip-connection mixing weights (training, inference), those of Upstage's checkpoint
    "rope_local_theta": ROPE_THETA, "short_conv_kernel_size": 4, "bskcn_tv": [0.9, 0.8],
    # Bailing V3's KDA layers without their low-rank gate projections, the only KDA vLLM builds (it raises otherwise)
    "no_kda_lora": True,
    # TeleFLM's muP on, at the scales that make it a no-op (logits x output_mult / mup_scale_factor)
    "use_mup": True, "mup_scale_factor": 1.0, "output_mult": 1.0,
}
# Sizes of fields only remote configs have: Bailing V3's shared expert (TINY_SIZES' shared_expert_intermediate_size),
# K2Horizon's RoPE part of a head (half of it: its partial RoPE, folded into q/k at load).
REMOTE_SIZES: dict[str, Any] = {"moe_shared_expert_intermediate_size": TINY_SIZES["shared_expert_intermediate_size"],
                                "rope_head_dim": TINY_SIZES["head_dim"] // 2,
                                # TeleChat2's (GPT-2's) names of the layer and head counts
                                "n_layer": TINY_SIZES["num_hidden_layers"], "n_head": TINY_SIZES["num_attention_heads"]}
# DeciLM's (Nemotron-NAS) block of a layer: attention with a KV head per query head group, a feed-forward of the tiny
# intermediate size (given, not derived from ffn_mult: that rounds up to multiples of 256), neither a no-op.
DECI_BLOCK: dict[str, dict[str, Any]] = {
    "attention": {"no_op": False, "replace_with_linear": False,
                  "n_heads_in_group": TINY_SIZES["num_attention_heads"] // TINY_SIZES["num_key_value_heads"]},
    "ffn": {"no_op": False, "replace_with_linear": False, "intermediate_size": TINY_SIZES["intermediate_size"]},
}
SLIDING_WINDOW = 128  # the window of a sliding-attention layer: half the tiny max_position_embeddings
# Fields whose values follow the tiny model's layers (its ``num_hidden_layers`` and ``layer_types``), each from what
# vLLM's model does with it:
# - ``layer_group_size`` (Bailing V2.5/V3): each group's last layer is full attention, the others linear, so a group
#   of all the layers gives one of each kind at 2 layers (``tiny_layout``'s rule);
# - ``bskcn_1``/``bskcn_2`` (Solar): the layers where a skip connection saves the hidden states and residual (from
#   layer 1: layer 0 has no residual yet), ``bskcn_3``/``bskcn_4`` the layers where it mixes them back in (the last);
# - ``interleaved_sliding_window`` (Plamo3): one window per layer, None for a full-attention layer of layer_types.
LAYOUT_RULES: dict[str, Callable[[int, list[str]], Any]] = {
    "layer_group_size": lambda layers, _: layers,
    "bskcn_1": lambda layers, _: [1], "bskcn_2": lambda layers, _: [1],
    "bskcn_3": lambda layers, _: [layers - 1], "bskcn_4": lambda layers, _: [layers - 1],
    "interleaved_sliding_window": lambda _, types: [None if t == "full_attention" else SLIDING_WINDOW for t in types],
    "block_configs": lambda layers, _: [DECI_BLOCK] * layers,
}
# Fields whose entries vLLM's model reads by attribute (``block_config.attention.no_op``), as the hub's config class
# makes them (DeciLM's BlockConfig dataclasses): the config module gives them as dicts that read by attribute too.
RECORD_FIELDS = frozenset({"block_configs"})
# MLA's head sizes (DeepSeek's names): transformers' DeepseekV3Config's defaults, not shrunk (vLLM's MLA backends take
# only the head sizes of real models, checkpoints.tiny_text_config). Written where the model reads one without a
# default or with one (Bailing V2.5's ``getattr(config, "kv_lora_rank", 512)``: its MLA layers' sizes, which the hub
# checkpoint has, and vLLM decides MLA attention by ``kv_lora_rank`` being set); not where it only tests for them
# (openPangu's hasattr) or reads them with an "off" default (``q_lora_rank`` None: no LoRA on the query).
MLA_FIELDS = ("kv_lora_rank", "q_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
# The head size of the architectures whose linear-attention layers run vLLM's lightning attention
# (layers/lightning_attn.py splits a head into blocks of 64 and asserts it a multiple of them; Bailing V2.5's
# BailingMoELinearAttention runs it through minimax_linear_attn.py): TINY_SIZES' 32 is none.
LIGHTNING_HEAD_DIM = 64
LIGHTNING_ATTENTION = frozenset({"BailingMoeV2_5ForCausalLM"})
# The model_type of a checkpoint vLLM branches on (ModelArchConfigConvertor.is_deepseek_mla, the rope validation it
# patches), where it is not the model module's name and vLLM's _ARCHITECTURE_TO_MODEL_TYPE does not have it. Bailing
# V3's is V2.5's ``bailing_hybrid``: vLLM's own config of its text decoder (BailingMoeV3TextConfig, of the V3-VL
# checkpoints) has that model_type, and its speculative config tells V3 from V2.5 by the architecture.
MODEL_TYPES = {"PanguUltraMoEForCausalLM": "pangu_ultra_moe", "SarvamMLAForCausalLM": "sarvam_mla",
               "BailingMoeV2_5ForCausalLM": "bailing_hybrid", "BailingMoeV3ForCausalLM": "bailing_hybrid",
               "DeciLMForCausalLM": "nemotron-nas"}
# What vLLM's engine reads of every text config (its ModelConfig), whether or not the model's module does.
ENGINE_FIELDS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "vocab_size",
                 "max_position_embeddings", "tie_word_embeddings")
# Attributes every PretrainedConfig has (transformers sets them), so a read of one needs no value.
BASE_ATTRIBUTES = frozenset({
    "architectures", "model_type", "dtype", "torch_dtype", "name_or_path", "auto_map", "quantization_config",
    "bos_token_id", "eos_token_id", "pad_token_id", "is_encoder_decoder", "output_hidden_states",
    "output_attentions", "return_dict", "use_return_dict", "id2label", "label2id", "num_labels", "problem_type",
    "tokenizer_class", "chunk_size_feed_forward", "_attn_implementation", "text_config", "sub_configs",
})


@dataclass(frozen=True)
class ConfigReads:
    """The config fields a model's source reads: ``required`` with no default, ``optional`` only with one, ``off``
    those it has a path without (tested with hasattr, or read with a default that says "off"): given a value where a
    rule knows one, and left out in a second try."""

    required: frozenset[str]
    optional: frozenset[str]
    off: frozenset[str] = frozenset()


def _is_config(node: ast.expr) -> bool:
    """Whether ``node`` is the model's config: ``config``, ``hf_config`` or ``self.config``."""
    if isinstance(node, ast.Name):
        return node.id in CONFIG_NAMES
    return isinstance(node, ast.Attribute) and node.attr == "config" and isinstance(node.value, ast.Name) \
        and node.value.id == "self"


def _is_off(default: ast.expr) -> bool:
    """Whether a getattr default says "absent means off": a constant 0, None, False or ""."""
    return isinstance(default, ast.Constant) and not default.value


def config_reads(source: str) -> ConfigReads:
    """The config fields ``source`` (a Python module) reads. Required: ``config.X`` / ``self.config.X`` /
    ``hf_config.X`` (not a method called: ``config.get_text_config()``) and ``getattr(config, "X")``. Optional:
    ``getattr(config, "X", default)`` where no plain read needs it. Off, whatever else reads them: any field
    ``hasattr(config, "X")`` tests (openPangu's MLA fields, read only where all are there) and any read with an "off"
    default (MiniCPM's ``getattr(config, "num_experts", 0)``: dense without). Required too: the names an
    ``attribute_map`` the model sets on its config maps to (TeleChat2's ``num_hidden_layers`` -> ``n_layer``): every
    read of the mapped name reads them."""
    tree = ast.parse(source)
    calls = [node for node in ast.walk(tree) if isinstance(node, ast.Call)]
    methods = {id(call.func) for call in calls}
    required = {node.attr for node in ast.walk(tree) if isinstance(node, ast.Attribute) and _is_config(node.value)
                and isinstance(node.ctx, ast.Load) and id(node) not in methods}
    required |= {value.value for node in ast.walk(tree) if isinstance(node, ast.Assign)
                 and isinstance(node.value, ast.Dict)
                 and any(isinstance(t, ast.Attribute) and t.attr == "attribute_map" for t in node.targets)
                 for value in node.value.values if isinstance(value, ast.Constant) and isinstance(value.value, str)}
    defaulted: set[str] = set()
    off: set[str] = set()
    for call in calls:
        name = call.func.id if isinstance(call.func, ast.Name) else ""
        if name in ("getattr", "hasattr") and len(call.args) >= 2 and _is_config(call.args[0]) \
                and isinstance(call.args[1], ast.Constant) and isinstance(call.args[1].value, str):
            field = call.args[1].value
            if name == "hasattr" or (len(call.args) >= 3 and _is_off(call.args[2])):
                off.add(field)
            else:
                (defaulted if len(call.args) >= 3 else required).add(field)
    return ConfigReads(frozenset(required - off), frozenset(defaulted - required - off), frozenset(off))


def _called(module: Any) -> frozenset[str]:
    """The names ``module``'s source calls (``BailingMLP(...)``)."""
    tree = ast.parse(inspect.getsource(module))
    return frozenset(node.func.id for node in ast.walk(tree) if isinstance(node, ast.Call)
                     and isinstance(node.func, ast.Name))


def _imported_layers(modules: list[Any]) -> list[type]:
    """The layers ``modules`` import from vLLM's other modules and build with the model's config (Bailing V2.5's
    ``BailingMLP`` from bailing_moe.py, ``BailingMoELinearAttention`` from layers/mamba/linear), whose constructors
    read it too: nn.Module classes called there whose constructor takes a ``config``, not whole models (those have
    ``load_weights``; a pooling model wrapping one reads only what it uses)."""
    import torch

    return list(dict.fromkeys(
        obj for module in modules for name, obj in vars(module).items()
        if isinstance(obj, type) and issubclass(obj, torch.nn.Module) and obj.__module__.startswith(VLLM_MODULES)
        and inspect.getmodule(obj) not in modules and name in _called(module) and not hasattr(obj, "load_weights")
        and "config" in inspect.signature(obj.__init__).parameters))


def model_config_reads(model_cls: type) -> ConfigReads:
    """The config fields read by the modules of vLLM's ``model_cls`` and of its nn.Module bases, and by the classes
    of vLLM's other model modules they import (``_imported_layers``)."""
    from pytest_enginecheck.targets.vllm.checkpoints.remote_config import model_modules as model_modules

    modules = model_modules(model_cls)
    sources = [inspect.getsource(m) for m in modules]
    sources += [textwrap.dedent(inspect.getsource(c)) for c in _imported_layers(modules)]
    reads = [config_reads(source) for source in sources]
    off = frozenset().union(*(r.off for r in reads))
    required = frozenset().union(*(r.required for r in reads)) - off
    return ConfigReads(required, frozenset().union(*(r.optional for r in reads)) - required - off, off)


def remote_model_type(architecture: str, model_cls: type, by_architecture: Mapping[str, str]) -> str:
    """The ``model_type`` of ``architecture``'s checkpoint: vLLM's ``by_architecture`` map's
    (``_ARCHITECTURE_TO_MODEL_TYPE``), else MODEL_TYPES', else the name of the module vLLM defines the model in."""
    return by_architecture.get(architecture) or MODEL_TYPES.get(architecture) \
        or model_cls.__module__.rpartition(".")[2]


def _mla_sizes() -> dict[str, Any]:
    from transformers import DeepseekV3Config

    defaults = DeepseekV3Config()
    return {field: getattr(defaults, field) for field in MLA_FIELDS}


def layout_values(layers: int, layer_types: list[str] | None, fields: frozenset[str]) -> dict[str, Any]:
    """The LAYOUT_RULES values of ``fields`` for a model of ``layers`` layers of ``layer_types`` (each full attention
    where None)."""
    types = list(layer_types or ["full_attention"] * layers)
    return {field: rule(layers, types) for field, rule in LAYOUT_RULES.items() if field in fields}


def field_values(architecture: str, reads: ConfigReads, leave_off: bool = False) -> dict[str, Any]:
    """A value for each field of ``reads.required`` (and ENGINE_FIELDS) by the rules of the module docstring, and
    for the optional and off fields a rule knows (the off fields left out with ``leave_off``). NoTinyCheckpoint
    naming the required fields no rule knows."""
    from pytest_enginecheck.targets.vllm.checkpoints.composite import ENCODER_SIZES
    from pytest_enginecheck.targets.vllm.checkpoints.shrink import VLLM_CONFIG_SIZES, tiny_sizes

    wanted = (reads.required | frozenset(ENGINE_FIELDS)) - (reads.off if leave_off else frozenset())
    optional = reads.optional | (frozenset() if leave_off else reads.off - wanted)
    sizes = tiny_sizes({field: TINY_SIZES.get(field) for field in wanted | optional})
    rules: dict[str, Any] = {**ENCODER_SIZES, **LLAMA_DEFAULTS, **REMOTE_SIZES, **VLLM_CONFIG_SIZES, **sizes}
    rules.update(layout_values(rules["num_hidden_layers"], rules.get("layer_types"), wanted | optional))
    mla = frozenset(MLA_FIELDS) & (wanted | reads.optional)  # read without a default, or with one (MLA_FIELDS)
    if mla:
        rules.update(_mla_sizes())
    if architecture in LIGHTNING_ATTENTION:
        rules["head_dim"] = LIGHTNING_HEAD_DIM
    unknown = sorted(wanted - rules.keys() - BASE_ATTRIBUTES)
    if unknown:
        raise NoTinyCheckpoint(f"vLLM's {architecture} reads the config field{'s' * (len(unknown) > 1)} "
                               f"{', '.join(unknown)}, which no rule of the checker's remote config gives a value "
                               f"(remote_config.py: the shrink tables, LLAMA_DEFAULTS)")
    return {field: rules[field] for field in sorted(wanted | optional) if field in rules
            and field not in BASE_ATTRIBUTES and (field in mla or field not in MLA_FIELDS)}


def config_module(model_type: str, values: Mapping[str, Any]) -> str:
    """The source of ``configuration_enginecheck.py``: a PretrainedConfig subclass of ``model_type`` whose
    constructor defaults are ``values`` (JSON values, written as Python literals)."""
    lines = [f'"""The tiny config pytest-enginecheck wrote for a checkpoint of model_type {model_type!r}."""',
             "", "import copy", "", "from transformers import PretrainedConfig", "", "",
             f"DEFAULTS = {values!r}",
             f"RECORD_FIELDS = {sorted(RECORD_FIELDS & values.keys())!r}", "", "",
             "class Record(dict):",
             '    """A dict whose keys read as attributes too (a field the model reads by attribute)."""', "",
             "    def __getattr__(self, name):",
             "        try:",
             "            return self[name]",
             "        except KeyError:",
             "            raise AttributeError(name) from None", "", "",
             "def record(value):",
             '    """``value`` with every dict in it a Record."""',
             "    if isinstance(value, dict):",
             "        return Record({key: record(item) for key, item in value.items()})",
             "    if isinstance(value, list):",
             "        return [record(item) for item in value]",
             "    return value", "", "",
             f"class {CLASS_NAME}(PretrainedConfig):",
             f'    """model_type {model_type!r}: every field vLLM\'s model reads, with its tiny default."""', "",
             f"    model_type = {model_type!r}", "",
             "    def __init__(self, **kwargs):",
             "        for name, value in DEFAULTS.items():",
             "            value = copy.deepcopy(kwargs.pop(name, value))",
             "            setattr(self, name, record(value) if name in RECORD_FIELDS else value)",
             "        super().__init__(**kwargs)", ""]
    return "\n".join(lines)


@dataclass(frozen=True)
class RemoteConfig:
    """A tiny config that only the checkpoint's own code defines: its model_type, field values and module source."""

    architecture: str
    model_type: str
    values: dict[str, Any]

    @property
    def source(self) -> str:
        """The text of configuration_enginecheck.py."""
        return config_module(self.model_type, self.values)

    def write(self, path: Path) -> None:
        """Write configuration_enginecheck.py into the checkpoint directory ``path``."""
        path.mkdir(parents=True, exist_ok=True)
        (path / MODULE_FILE).write_text(self.source)

    def config(self) -> Any:
        """An instance of the config class (from the module's source), architectures and dtype set."""
        namespace: dict[str, Any] = {"__name__": f"enginecheck_remote_config_{self.model_type}"}
        exec(compile(self.source, MODULE_FILE, "exec"), namespace)  # the module this file just wrote
        config = namespace[CLASS_NAME]()
        config.architectures = [self.architecture]
        set_float32(config)  # issue 34: the field older transformers reads and saves (config_dtype.py)
        config.auto_map = dict(AUTO_MAP)
        return config


def tiny_remote_configs(architecture: str, model_cls: type, by_architecture: Mapping[str, str]
                        ) -> list[RemoteConfig]:
    """The remote configs of ``architecture`` to try in turn: its model_type and a value for each field its modules
    read; then, where that differs, the one without the fields read with an "off" default (the model's path without
    them: MiniCPM dense where its MoE's checkpoint does not round-trip). NoTinyCheckpoint naming a field no rule
    knows."""
    if getattr(model_cls, "supports_multimodal", False):
        raise NoTinyCheckpoint(f"vLLM's {architecture} is multimodal and its config comes from remote code: the "
                               f"checker's remote config covers text decoders only")
    reads = model_config_reads(model_cls)
    model_type = remote_model_type(architecture, model_cls, by_architecture)
    configs = [RemoteConfig(architecture, model_type, field_values(architecture, reads))]
    without_off = RemoteConfig(architecture, model_type, field_values(architecture, reads, leave_off=True))
    return [*configs, without_off] if without_off != configs[0] else configs


def is_remote_config(config: Mapping[str, Any]) -> bool:
    """Whether the config.json ``config`` names the checker's remote config (its ``auto_map``)."""
    auto_map = config.get("auto_map")
    return isinstance(auto_map, dict) and auto_map.get("AutoConfig") == AUTO_MAP["AutoConfig"]


def engine_args(ckpt: str | Path) -> dict[str, Any]:
    """vLLM's arguments for the checkpoint at ``ckpt``: ``trust_remote_code`` where its config is the checker's
    remote config (its configuration_enginecheck.py beside config.json), none otherwise."""
    path = Path(ckpt)
    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        return {}
    return {"trust_remote_code": True} if is_remote_config(config) and (path / MODULE_FILE).is_file() else {}


def model_modules(model_cls: type) -> list[Any]:
    """The modules of the model class and of its nn.Module bases (where vLLM's model code imports its config)."""
    import inspect

    import torch

    modules = [inspect.getmodule(c) for c in model_cls.__mro__
               if issubclass(c, torch.nn.Module) and not c.__module__.startswith("torch.")]
    return list(dict.fromkeys(m for m in modules if m is not None))
