"""The shrink rules: what every size field of a tiny config becomes, and the config built with them.

``TINY_SIZES`` (transformers' field names) and ``VLLM_CONFIG_SIZES`` (vLLM's own configs' names) are applied where a
config has the field; ``tiny_text_config`` builds a text decoder's config class with them. NoTinyCheckpoint is what
every writer raises where no tiny checkpoint can be made, with the reason.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Mapping, Sequence
from typing import Any

SEED = 0
# A tiny checkpoint's ceiling (float32: 256 MiB); the tiny Llama has ~0.1M. More means a size field kept its full value.
MAX_TINY_PARAMETERS = 64_000_000
# Applied only where the config has the field. A config with a head_dim field gets heads * head_dim = 128, not
# hidden_size (64), as Gemma's and Qwen3's published configs have it: a model that derives the head size
# as hidden_size // heads then builds another model (families without the field derive 64 / 2 = 32, the smallest
# head vLLM's CPU attention takes). One KV head for two query heads, as real configs group them (a GQA bug,
# "kv_heads = heads", shows), and fewer KV heads than TP=2's ranks: vLLM then replicates the KV head on every rank,
# the home of shard-selection bugs. sliding_window: tiny_sizes sets TINY_WINDOW where the family uses one.
TINY_SIZES: dict[str, Any] = {
    "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 2,
    "num_key_value_heads": 1, "head_dim": 64, "vocab_size": 256, "max_position_embeddings": 256,
    "num_local_experts": 4, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 64,
    "shared_expert_intermediate_size": 64, "sliding_window": None, "max_window_layers": 2,
    "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": None,
    # Gemma 3n: no layer shares another's KV (its 15 shared layers outnumber the tiny model's), a tiny per-layer input
    "num_kv_shared_layers": 0, "vocab_size_per_layer_input": 256, "hidden_size_per_layer_input": 32,
    # LongCat-Flash's zero-computation (identity) experts beside its routed ones (256 beside 512 on the hub)
    "zero_expert_num": 2,
}
# The sliding window of a family whose default config has one (Gemma 2/3, Cohere 2, GPT-OSS, Olmo 3, Mistral):
# shorter than every prompt the load check runs (29, 33 and 122 tokens on vLLM), so a model that ignores it, or
# applies it to the wrong layers, attends to keys the reference does not.
TINY_WINDOW = 16
# The rope scaling of the families whose published configs scale and whose transformers default config does not
# (Llama 3.1-3.3's llama3; Gemma 3's linear factor 8 on its global layers), by model_type: a function of the default
# config's rope_parameters. original_max_position_embeddings 64 of the tiny 256 positions, as Llama 3.1's 8192 of its
# 131072, so the scaled frequencies turn the keys of every prompt: a model that drops the scaling computes another
# rotation. Families whose default config already scales (Apertus and CWM's llama3, GPT-OSS' and Ministral 3's yarn)
# keep their default's.
LLAMA3_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 64}
FAMILY_ROPE_SCALING: dict[str, Any] = {
    "llama": lambda rope: {**rope, **LLAMA3_SCALING},
    "gemma3_text": lambda rope: {**rope, "full_attention": {**rope["full_attention"], "rope_type": "linear",
                                                             "factor": 8.0}},
}
# Grouped expert routing (DeepSeek's n_group, topk_group): transformers' DeepseekV2Config leaves them None, which vLLM's
# deepseek_v2.py passes on to a router that then asserts them set (hub checkpoints set them); one group, as vLLM assumes
# where the config has no such field.
GROUP_ROUTING = ("n_group", "topk_group")
# Grouped routing set (DeepSeek V3's 8 groups, top 4) over the tiny experts (TINY_SIZES' 4): 2 groups of 2, the top
# group's 2 experts routed to (TINY_SIZES' num_experts_per_tok); 8 groups of 4 experts leave no expert in a group.
TINY_GROUPS = {"n_group": 2, "topk_group": 1}
# The count of dense (MLP) layers before the first MoE layer: at most all layers but one, so the tiny model keeps a
# MoE layer (Lfm2-MoE's 2 dense layers of 2 left none, and vLLM's lfm2_moe.py raises where it finds no MoE block).
# Not DeepSeek V3's first_k_dense_replace (3): its all-dense tiny model runs, and a MoE layer would route with sigmoid
# scores in groups, which vLLM's CPU MoE router lacks (limits.py).
DENSE_PREFIX = ("num_dense_layers",)
EXPERT_COUNTS = ("num_local_experts", "num_experts")
EXPERT_FIELDS = (*EXPERT_COUNTS, "num_experts_per_tok", "moe_intermediate_size", "shared_expert_intermediate_size")


class NoTinyCheckpoint(Exception):
    """No tiny checkpoint can be made for the architecture; the message says why."""


def tiny_sizes(fields: Mapping[str, Any]) -> dict[str, Any]:
    """The sizes a tiny config is built with, from the fields its default config has (name -> default value).

    TINY_SIZES where the config has the field; a router that picks fewer experts per token than TINY_SIZES (Llama
    4's top-1) keeps its own number; a config without experts by default keeps its expert fields; a window
    (``sliding_window``) is TINY_WINDOW where the default has one and ``use_sliding_window`` does not turn it off,
    else None; a config that lists ``layer_types`` gets full-attention layers, or, where it has sliding-window layers
    and a window, sliding-window layers and a full-attention last one (Gemma's order); grouped routing left None gets
    one group, grouped routing set gets TINY_GROUPS over the tiny experts; a dense-layer count (DENSE_PREFIX) leaves
    one MoE layer; a partial rotary ``rotary_dim`` keeps its proportion of the head.
    """
    sizes = {k: v for k, v in TINY_SIZES.items() if k in fields}
    counts = [fields[k] for k in EXPERT_COUNTS if k in fields]
    if counts and not any(counts):
        # no experts by default (Gemma 4's num_experts=None): a dense model, which vLLM tells by the expert count
        sizes = {k: v for k, v in sizes.items() if k not in EXPERT_FIELDS}
    if "attention_hidden_size" in fields:
        # Zamba's shared attention runs on [hidden, embeddings] (2 * hidden_size); its __post_init__ derives the
        # head size (``head_dim`` is an alias of it), which a tiny head_dim would contradict. Its published configs
        # give it as many KV heads as query heads; with one, vLLM's Zamba2 failed in load_model ("start (0) + length
        # (128) exceeds dimension size (64)"), a config no Zamba checkpoint has
        sizes.pop("head_dim", None)
        if "num_attention_heads" in sizes:
            sizes["num_key_value_heads"] = sizes["num_attention_heads"]
    if isinstance(fields.get("num_experts_per_tok"), int):
        sizes["num_experts_per_tok"] = min(fields["num_experts_per_tok"], TINY_SIZES["num_experts_per_tok"])
    if "sliding_window" in fields:
        sizes["sliding_window"] = TINY_WINDOW if uses_window(fields) else None
    if "layer_types" in fields:
        layers = sizes.get("num_hidden_layers", 2)
        windowed = sizes.get("sliding_window") and "sliding_attention" in (fields["layer_types"] or ())
        # Gemma's order: sliding-window layers first, the global one last (every Gemma 2 and 3 pattern starts so)
        sizes["layer_types"] = (["sliding_attention"] * (layers - 1) + ["full_attention"] if windowed
                                else ["full_attention"] * layers)
    for group in GROUP_ROUTING:
        if group in fields and fields[group] is None:
            sizes[group] = 1
    if isinstance(fields.get("n_group"), int) and fields["n_group"] > 1 and any(k in sizes for k in EXPERT_COUNTS):
        sizes.update(TINY_GROUPS)
    layers = sizes.get("num_hidden_layers", fields.get("num_hidden_layers"))
    for dense in DENSE_PREFIX:
        if isinstance(fields.get(dense), int) and isinstance(layers, int) and fields[dense] >= layers:
            sizes[dense] = max(layers - 1, 0)
    if isinstance(fields.get("rotary_dim"), int):
        sizes["rotary_dim"] = _tiny_rotary_dim(fields, sizes)
    if isinstance(fields.get("num_heads"), int) and isinstance(fields.get("expand"), int) and "head_dim" in sizes:
        # Mamba2's SSM heads: hidden_size * expand == num_heads * head_dim, in groups that divide the heads
        hidden = sizes.get("hidden_size", fields.get("hidden_size", 0))
        sizes["num_heads"] = hidden * fields["expand"] // sizes["head_dim"]
        if isinstance(fields.get("n_groups"), int):
            sizes["n_groups"] = min(fields["n_groups"], 2)
    return sizes


def uses_window(fields: Mapping[str, Any]) -> bool:
    """Whether a default config uses a sliding window: a positive ``sliding_window`` that ``use_sliding_window``
    (Qwen2's switch, off in its published configs) does not turn off."""
    window = fields.get("sliding_window")
    return isinstance(window, int) and window > 0 and fields.get("use_sliding_window", True) is not False


def family_rope_parameters(model_type: str, rope: Any) -> Any:
    """The tiny config's ``rope_parameters`` of a ``model_type`` in FAMILY_ROPE_SCALING (its family's scaling on the
    default config's ``rope``), else None: the default's stays."""
    scale = FAMILY_ROPE_SCALING.get(model_type)
    return scale(rope) if scale is not None and isinstance(rope, dict) else None


def head_size(sizes: Mapping[str, Any]) -> int | None:
    """The attention head size of ``sizes``: its head_dim, else hidden_size / num_attention_heads (None unknown)."""
    if isinstance(sizes.get("head_dim"), int):
        return int(sizes["head_dim"])
    hidden, heads = sizes.get("hidden_size"), sizes.get("num_attention_heads")
    return hidden // heads if isinstance(hidden, int) and isinstance(heads, int) and heads else None


def _tiny_rotary_dim(fields: Mapping[str, Any], sizes: Mapping[str, Any]) -> int:
    """The rotary part of a tiny head (``rotary_dim``: GPT-J's 64 of a 256 head) in the default's proportion, even, at
    least 2 and at most the head: kept as it is (64), it is twice the tiny head, which vLLM's RoPE refuses."""
    head, tiny_head = head_size(fields), head_size({**fields, **sizes})
    if not head or not tiny_head:
        return int(fields["rotary_dim"])
    return max(2, min(tiny_head, tiny_head * fields["rotary_dim"] // head) // 2 * 2)


ATTENTION_LAYER_TYPES = frozenset({"full_attention", "sliding_attention", "chunked_attention"})


def tiny_layout(layer_types: Sequence[str], layers: int) -> dict[str, Any]:
    """A hybrid's per-layer kinds shrunk consistently: each attention layer full attention, one layer of every other
    kind (mamba, linear attention, a shared block) in the order it first appears, cycled over ``layers`` layers (more
    when there are more kinds). For the configs whose validators refuse an all-attention tiny model."""
    kinds = list(dict.fromkeys("full_attention" if t in ATTENTION_LAYER_TYPES else str(t) for t in layer_types))
    kinds = kinds or ["full_attention"]
    count = max(layers, len(kinds))
    return {"num_hidden_layers": count, "layer_types": [kinds[i % len(kinds)] for i in range(count)]}


def _read_only(config_cls: type, name: str) -> bool:
    """Whether ``name`` is a property of ``config_cls`` with no setter (FalconConfig.head_dim, Mamba2's layer_types)."""
    attribute = inspect.getattr_static(config_cls, name, None)
    return isinstance(attribute, property) and attribute.fset is None


def _admits_none(config_cls: type, name: str) -> bool:
    """Whether the config's (strict dataclass) field ``name`` may be None: False where it is typed without None
    (Gemma3n's ``sliding_window: int``), True where nothing says otherwise."""
    if not dataclasses.is_dataclass(config_cls):
        return True
    field = next((f for f in dataclasses.fields(config_cls) if f.name == name), None)
    return field is None or any(word in str(field.type) for word in ("None", "Optional", "Any"))


_MISSING = object()


def _default(defaults: Any, name: str) -> Any:
    """The default config's value of ``name``, or ``_MISSING`` where reading it raises (no such field, or Gemma 4's
    per-layer ``head_dim``, which refuses a global read)."""
    try:
        return getattr(defaults, name)
    except Exception:  # noqa: BLE001 - any refusal means: not a field to shrink
        return _MISSING


def _build(config_cls: type, sizes: dict[str, Any]) -> tuple[Any, Exception | None]:
    """``config_cls(**sizes)``, or None and what it raised (any exception: the config's validators are the limit).

    A size named by an alias (the class's ``attribute_map``: Zamba2's ``head_dim`` and ``layer_types``) is passed
    under the field's own name, so the config's ``__post_init__`` derives the fields that depend on it from it
    (an alias is set after it: Zamba2's ``hybrid_layer_ids`` stayed the defaults')."""
    aliases = getattr(config_cls, "attribute_map", None) or {}
    try:
        return config_cls(**{aliases.get(k, k): v for k, v in sizes.items()}), None
    except Exception as e:  # noqa: BLE001 - TypeError, ValueError, huggingface_hub's StrictDataclass*Error, ...
        return None, e


def tiny_text_config(config_cls: type, defaults: Any, more_sizes: Mapping[str, Any] | None = None) -> Any:
    """A text decoder's config class with TINY_SIZES applied; ``defaults`` is its default config. ``more_sizes``:
    sizes of other fields, applied where the config has them (vLLM's own configs' names: vllm_weights.py)."""
    names = (*TINY_SIZES, "num_heads", "expand", "n_groups", "attention_hidden_size", *GROUP_ROUTING, *DENSE_PREFIX,
             "rotary_dim", "use_sliding_window")
    fields = {k: v for k in names if (v := _default(defaults, k)) is not _MISSING}
    if "layer_types" in defaults.to_dict():
        fields["layer_types"] = defaults.layer_types
    # Never set a read-only property; where a field refuses None (an int-typed sliding_window), keep its default.
    aliases = getattr(config_cls, "attribute_map", None) or {}
    more = {k: v for k, v in (more_sizes or {}).items() if _default(defaults, k) is not _MISSING}
    rope = family_rope_parameters(str(getattr(config_cls, "model_type", "")), _default(defaults, "rope_parameters"))
    if rope is not None:
        more["rope_parameters"] = rope
    sizes = {k: v for k, v in {**tiny_sizes(fields), **more}.items() if not _read_only(config_cls, aliases.get(k, k))
             and (v is not None or _admits_none(config_cls, aliases.get(k, k)))}
    if aliases.get("num_key_value_heads", "num_key_value_heads") == aliases.get("num_attention_heads"):
        # one field under both names (Whisper's encoder_attention_heads): it counts the query heads
        sizes.pop("num_key_value_heads", None)
    if aliases.get("head_dim") == "qk_rope_head_dim":
        # MLA whose ``head_dim`` is the rope part (GLM-4.7-Flash): vLLM's MLA backends take only the head sizes of
        # real models (kv_lora_rank + qk_rope_head_dim = 576), so the rope part keeps its default
        sizes.pop("head_dim", None)
    config, error = _build(config_cls, sizes)
    layer_types = _default(defaults, "layer_types")
    if config is None and isinstance(layer_types, list) and not _read_only(config_cls, "layer_types"):
        config, _ = _build(config_cls, {**sizes, **tiny_layout(layer_types, sizes.get("num_hidden_layers", 2))})
    if config is None:
        raise NoTinyCheckpoint(f"{config_cls.__name__} refuses the tiny sizes {sizes}: {type(error).__name__}: {error}")
    return config


# Size fields of vLLM's own configs (vllm.transformers_utils.configs), where the config has them: ChatGLM's and
# Step3's names for what TINY_SIZES calls intermediate_size, vocab_size, head_dim, max_position_embeddings, the expert
# counts and the key/value head groups.
VLLM_CONFIG_SIZES: dict[str, Any] = {
    "ffn_hidden_size": 128, "padded_vocab_size": 256, "kv_channels": 32, "seq_length": 256, "max_seq_len": 256,
    "max_position_embedding": 256, "moe_num_experts": 4, "moe_top_k": 2, "share_expert_dim": 64, "share_q_dim": 64,
    "num_attention_groups": 2,
}
