"""Tiny Hugging Face checkpoints for vLLM architectures, from transformers' own config classes.

The architecture's transformers class gives its config class; the config is built with every size
shrunk (``TINY_SIZES``: head_dim 32, since vLLM's CPU attention rejects 16), the model is built with
random weights under a fixed seed and saved in HF layout with safetensors. An architecture with no
transformers class gets its config class from vLLM and its weights from vLLM's model (vllm_weights.py); one whose
config refuses the tiny sizes, or for which neither way works, raises NoTinyCheckpoint with the reason.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import json
import os
import re
import shutil
import tempfile
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

SEED = 0
# A tiny checkpoint's ceiling (float32: 256 MiB); the tiny Llama has ~0.1M. More means a size field kept its full value.
MAX_TINY_PARAMETERS = 64_000_000
# Applied only where the config has the field; heads * head_dim == hidden_size keeps every family happy.
TINY_SIZES: dict[str, Any] = {
    "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 2,
    "num_key_value_heads": 2, "head_dim": 32, "vocab_size": 256, "max_position_embeddings": 256,
    "num_local_experts": 4, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 64,
    "shared_expert_intermediate_size": 64, "sliding_window": None, "max_window_layers": 2,
    "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": None,
    # Gemma 3n: no layer shares another's KV (its 15 shared layers outnumber the tiny model's), a tiny per-layer input
    "num_kv_shared_layers": 0, "vocab_size_per_layer_input": 256, "hidden_size_per_layer_input": 32,
    # LongCat-Flash's zero-computation (identity) experts beside its routed ones (256 beside 512 on the hub)
    "zero_expert_num": 2,
}


# Fields of a sub-config that the hub's checkpoints have and transformers' config class moved elsewhere, while a model
# still reads them there, by (sub-config, field): the value from where the class keeps it. DBRX's attention's
# rope_theta (transformers' DbrxConfig keeps it in rope_parameters; its own modeling_dbrx.py and vLLM's dbrx.py read
# attn_config.rope_theta). The sub-config keeps it as an extra attribute and writes it to config.json.
SUB_CONFIG_HUB_FIELDS: dict[tuple[str, str], Callable[[Any], Any]] = {
    ("attn_config", "rope_theta"): lambda config: (getattr(config, "rope_parameters", None) or {}).get("rope_theta"),
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
    4's top-1) keeps its own number; a config without experts by default keeps its expert fields; a config that
    lists ``layer_types`` gets one full-attention layer per layer; grouped routing left None gets one group, grouped
    routing set gets TINY_GROUPS over the tiny experts; a dense-layer count (DENSE_PREFIX) leaves one MoE layer; a
    partial rotary ``rotary_dim`` keeps its proportion of the head.
    """
    sizes = {k: v for k, v in TINY_SIZES.items() if k in fields}
    counts = [fields[k] for k in EXPERT_COUNTS if k in fields]
    if counts and not any(counts):
        # no experts by default (Gemma 4's num_experts=None): a dense model, which vLLM tells by the expert count
        sizes = {k: v for k, v in sizes.items() if k not in EXPERT_FIELDS}
    if "attention_hidden_size" in fields:
        # Zamba's shared attention runs on [hidden, embeddings] (2 * hidden_size); its __post_init__ derives the
        # head size (``head_dim`` is an alias of it), which a tiny head_dim would contradict
        sizes.pop("head_dim", None)
    if isinstance(fields.get("num_experts_per_tok"), int):
        sizes["num_experts_per_tok"] = min(fields["num_experts_per_tok"], TINY_SIZES["num_experts_per_tok"])
    if "layer_types" in fields:
        sizes["layer_types"] = ["full_attention"] * sizes.get("num_hidden_layers", 2)
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


def _head_size(sizes: Mapping[str, Any]) -> int | None:
    """The attention head size of ``sizes``: its head_dim, else hidden_size / num_attention_heads (None unknown)."""
    if isinstance(sizes.get("head_dim"), int):
        return int(sizes["head_dim"])
    hidden, heads = sizes.get("hidden_size"), sizes.get("num_attention_heads")
    return hidden // heads if isinstance(hidden, int) and isinstance(heads, int) and heads else None


def _tiny_rotary_dim(fields: Mapping[str, Any], sizes: Mapping[str, Any]) -> int:
    """The rotary part of a tiny head (``rotary_dim``: GPT-J's 64 of a 256 head) in the default's proportion, even, at
    least 2 and at most the head: kept as it is (64), it is twice the tiny head, which vLLM's RoPE refuses."""
    head, tiny_head = _head_size(fields), _head_size({**fields, **sizes})
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


def hf_class(architecture: str, model_cls: type | None = None) -> Any:
    """The transformers class for an architecture: its own name, else the nearest base class of the vLLM
    model class that transformers has (an out-of-tree ``MyLlama(LlamaForCausalLM)`` uses Llama's)."""
    import transformers

    names = [architecture, *(base.__name__ for base in (model_cls.__mro__ if model_cls else ()))]
    try:
        found = next((getattr(transformers, n) for n in names if isinstance(getattr(transformers, n, None), type)),
                     None)
    except Exception as e:  # noqa: BLE001 - transformers' lazy import of its modeling module failed here
        raise NoTinyCheckpoint(f"transformers {transformers.__version__} cannot import its class for {architecture!r}: "
                               f"{type(e).__name__}: {e}") from None
    if found is None:
        raise NoTinyCheckpoint(f"transformers {transformers.__version__} has no class {architecture!r} (nor one of its "
                               f"base classes), so there is no config class to shrink")
    return found


def foreign_base(architecture: str, model_cls: type | None, hf: Any) -> str:
    """Why the transformers class ``hf`` of a base class of vLLM's ``model_cls`` cannot make ``architecture``'s
    checkpoint, or "": the config fields that vLLM's classes above that base read without a default (the sources of
    their modules, ``remote_config.config_reads``) and its default config has not (vLLM's TeleChat2ForCausalLM, a
    LlamaForCausalLM, reads its hub config's ``n_head``; TeleFLM's ``use_mup``: their configs are not Llama's)."""
    if model_cls is None or hf.__name__ == architecture:
        return ""
    from pytest_enginecheck.targets.vllm.remote_config import config_reads

    names = [cls.__name__ for cls in model_cls.__mro__]
    base = names.index(hf.__name__) if hf.__name__ in names else len(names)
    # the modules of vLLM's classes above the base, not the base's own (whose reads the base config answers)
    below = {inspect.getmodule(cls) for cls in model_cls.__mro__[base:]}
    above = [module for cls in model_cls.__mro__[:base] if (module := inspect.getmodule(cls)) not in below]
    try:
        defaults = hf.config_class()
        reads = [config_reads(inspect.getsource(m)).required for m in dict.fromkeys(above) if m is not None]
    except Exception:  # noqa: BLE001 - no default config or no source: judged where the checkpoint is built
        return ""
    missing = sorted(f for f in frozenset().union(*reads) if not hasattr(defaults, f))
    if not missing:
        return ""
    return (f"vLLM's {architecture} reads the config field{'s' * (len(missing) > 1)} {', '.join(missing)}, which "
            f"{type(defaults).__name__} of its base class {hf.__name__} has not: its checkpoint is not that class's")


def tiny_config(architecture: str, model_cls: type | None = None) -> Any:
    """The architecture's transformers config with TINY_SIZES applied."""
    hf = hf_class(architecture, model_cls)
    config_cls = getattr(hf, "config_class", None)
    if config_cls is None:
        raise NoTinyCheckpoint(f"transformers.{architecture} declares no config_class")
    try:
        defaults = config_cls()
    except Exception as e:  # noqa: BLE001 - transformers' limit: the config needs arguments the checker cannot know
        raise NoTinyCheckpoint(f"{config_cls.__name__}() cannot be built with its defaults: {type(e).__name__}: {e}"
                               ) from None
    from pytest_enginecheck.targets.vllm import composite

    if composite.is_composite(defaults):  # a multimodal config: its text decoder shrunk by tiny_text_config
        config = composite.tiny_composite_config(config_cls, defaults, tiny_text_config)
    else:
        config = tiny_text_config(config_cls, defaults)
    for (sub, field), value in SUB_CONFIG_HUB_FIELDS.items():
        sub_config = getattr(config, sub, None)
        if sub_config is not None and not hasattr(sub_config, field):
            setattr(sub_config, field, value(config))
    config.architectures = [architecture]
    config.dtype = "float32"
    return config


def tiny_text_config(config_cls: type, defaults: Any, more_sizes: Mapping[str, Any] | None = None) -> Any:
    """A text decoder's config class with TINY_SIZES applied; ``defaults`` is its default config. ``more_sizes``:
    sizes of other fields, applied where the config has them (vLLM's own configs' names: vllm_weights.py)."""
    names = (*TINY_SIZES, "num_heads", "expand", "n_groups", "attention_hidden_size", *GROUP_ROUTING, *DENSE_PREFIX,
             "rotary_dim")
    fields = {k: v for k in names if (v := _default(defaults, k)) is not _MISSING}
    if "layer_types" in defaults.to_dict():
        fields["layer_types"] = defaults.layer_types
    # Never set a read-only property; where a field refuses None (an int-typed sliding_window), keep its default.
    aliases = getattr(config_cls, "attribute_map", None) or {}
    more = {k: v for k, v in (more_sizes or {}).items() if _default(defaults, k) is not _MISSING}
    sizes = {k: v for k, v in {**tiny_sizes(fields), **more}.items() if not _read_only(config_cls, aliases.get(k, k))
             and (v is not None or _admits_none(config_cls, aliases.get(k, k)))}
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


def make_tiny_checkpoint(architecture: str, path: Path, model_cls: type | None = None) -> Path:
    """Write the tiny checkpoint of ``architecture`` to ``path`` (config.json + model.safetensors)."""
    import torch

    from pytest_enginecheck.targets.vllm import composite, tokenizer

    try:
        no_class = foreign_base(architecture, model_cls, hf_class(architecture, model_cls))
    except NoTinyCheckpoint as e:
        no_class = str(e)
    if no_class:  # no transformers class, or a base class's whose config is not its: vLLM's config class, weights
        # from vLLM's model (outside the except block: what its fork raises is then not chained to this, and
        # limits.py finds the frame that raised it)
        from pytest_enginecheck.targets.vllm import vllm_weights

        return vllm_weights.make_vllm_checkpoint(architecture, path, model_cls, reason=no_class)
    config = tiny_config(architecture, model_cls)
    config.dtype = torch.float32  # transformers' modeling code may read it as a torch.dtype (Apertus' xIELU)
    too_large = _too_large(hf_class(architecture, model_cls), config)
    if too_large:
        raise NoTinyCheckpoint(f"the tiny config of {architecture} still makes {too_large}: a size field the shrink "
                               f"rules do not know")
    torch.manual_seed(SEED)
    try:
        model = hf_class(architecture, model_cls)(config).to(torch.float32)
    except Exception as e:  # noqa: BLE001 - transformers' own limits, not the vLLM model's fault
        raise NoTinyCheckpoint(f"transformers cannot build a tiny {architecture}: {type(e).__name__}: {e}") from None
    try:
        _save_without_progress_bar(model, path)
        composite.undo_doubled_prefixes(path, model)
        drop_zero_experts(path, config)
        rename_written(path, str(getattr(config, "model_type", "")))
    except Exception as e:  # noqa: BLE001 - transformers' writer refusing the tiny model, not the vLLM model
        raise NoTinyCheckpoint(f"transformers cannot save a tiny {architecture}: {type(e).__name__}: {e}") from None
    config_path = Path(path) / "config.json"
    saved = json.loads(config_path.read_text())
    saved["architectures"] = [architecture]  # save_pretrained writes the transformers class's name
    saved.update({k: v for k, v in hub_fields(saved).items() if k not in saved})
    config_path.write_text(json.dumps(saved, indent=2))
    add_hub_norms(path, saved)
    tokenizer.write_tokenizer_if_needed(architecture, path, model_cls)  # only where vLLM reads one (tokenizer.py)
    return path


def zero_expert_tensors(names: Iterable[str], routed_experts: int) -> list[str]:
    """The names among ``names`` of experts numbered ``routed_experts`` and up (``mlp.experts.4.gate_proj.weight``
    where 4 experts are routed): zero-computation experts, which have no weights."""
    return [name for name in names if (m := re.search(r"\.experts\.(\d+)\.", name)) and int(m[1]) >= routed_experts]


def drop_zero_experts(path: Path, config: Any) -> list[str]:
    """Remove from the checkpoint at ``path`` the tensors transformers' writer made for zero-computation experts, and
    return their names. LongCat-Flash's ``zero_expert_num`` identity experts have no weights (the hub checkpoints
    have ``n_routed_experts`` experts), but transformers' LongcatFlashExperts allocates the fused gate/up projection
    of all of them, and its writer splits that into ``experts.N.gate_proj``/``up_proj`` of every one, which vLLM's
    loader, knowing the routed experts only, raises a KeyError on."""
    from safetensors.torch import load_file, save_file

    routed = getattr(config, "n_routed_experts", None)
    if not getattr(config, "zero_expert_num", None) or not isinstance(routed, int):
        return []
    dropped = []
    for file in sorted(Path(path).glob("*.safetensors")):
        tensors = load_file(file)
        zero = zero_expert_tensors(tensors, routed)
        if zero:
            dropped += zero
            save_file({n: t for n, t in tensors.items() if n not in zero}, file, metadata={"format": "pt"})
    return dropped


# Names transformers' writer gets wrong, by model_type: (pattern, replacement) over the names it wrote, giving the hub
# checkpoints' names. HY V4: transformers reads the hub's ``layers.N.hc_attn_layer.hc_pre.hc_base`` by dropping the
# ``.hc_pre`` of ``.hc_pre.hc_`` first (conversion_mapping.py), and its writer puts it back before the first ``.hc_``
# of the name: ``layers.N.hc_pre.hc_attn_layer.hc_base``, and ``hc_pre.hc_head.hc_head_base`` for the hub's
# ``hc_head.hc_head_base``; vLLM's hy_v4 loads the hub's names.
WRITTEN_NAMES: dict[str, list[tuple[str, str]]] = {
    "hy_v4": [(r"\.hc_pre\.hc_head\.", ".hc_head."), (r"\.hc_pre\.(hc_(?:attn|mlp)_layer)\.", r".\1.hc_pre.")],
}


def rename_written(path: Path, model_type: str) -> list[str]:
    """Rename the tensors of the checkpoint at ``path`` by WRITTEN_NAMES' rules of ``model_type``; the names renamed."""
    from safetensors.torch import load_file, save_file

    renamed = []
    for file in sorted(Path(path).glob("*.safetensors")) if WRITTEN_NAMES.get(model_type) else []:
        tensors = load_file(file)
        names = {name: written_name(name, model_type) for name in tensors}
        if any(new != name for name, new in names.items()):
            renamed += [name for name, new in names.items() if new != name]
            save_file({names[n]: t for n, t in tensors.items()}, file, metadata={"format": "pt"})
    return renamed


def written_name(name: str, model_type: str) -> str:
    """``name`` as the hub checkpoints of ``model_type`` name it (WRITTEN_NAMES)."""
    for pattern, replacement in WRITTEN_NAMES.get(model_type, []):
        name = re.sub(pattern, replacement, name)
    return name


# Norms the hub checkpoints of a model_type have and transformers' model has not (so its writer leaves them out), by
# model_type: (name, size) from the config.json written. A.X K1's post-MLP RMSNorm is in every layer ("after the
# MLP/MoE block in each layer", its authors' transformers PR #45334), and vLLM's AXK1 builds and loads it in every
# layer; transformers' AXK1 keeps it in the MoE block only, none in the first_k_dense_replace dense layers.
HUB_NORMS: dict[str, Callable[[Mapping[str, Any]], list[tuple[str, int]]]] = {
    "axk1": lambda s: [(f"model.layers.{i}.post_mlp_layernorm.weight", s["hidden_size"])
                       for i in range(min(s.get("first_k_dense_replace") or 0, s["num_hidden_layers"]))],
}


def add_hub_norms(path: Path, saved: Mapping[str, Any]) -> list[str]:
    """Add HUB_NORMS' norms of the config.json ``saved`` to the checkpoint at ``path`` (a norm's weight: ones), those
    it has not; the names added."""
    import torch
    from safetensors.torch import load_file, save_file

    norms = HUB_NORMS.get(str(saved.get("model_type")), lambda s: [])(saved)
    file = Path(path) / "model.safetensors"
    if not norms or not file.is_file():
        return []
    tensors = load_file(file)
    added = {name: torch.ones(size) for name, size in norms if name not in tensors}
    if added:
        save_file({**tensors, **added}, file, metadata={"format": "pt"})
    return sorted(added)


def _too_large(hf_cls: type, config: Any) -> str:
    """What makes the model of ``config`` larger than MAX_TINY_PARAMETERS, counted on the meta device before anything
    is allocated (a field the rules left at its full size would otherwise allocate gigabytes); "" when it fits, or
    when the class cannot be built on the meta device (the real build then says what it says)."""
    import torch

    try:
        with torch.device("meta"):
            model = hf_cls(config)
    except Exception:  # noqa: BLE001 - e.g. a constructor reading a tensor's value: judged by the real build
        return ""
    tensors = [*model.named_parameters(), *model.named_buffers()]
    total = sum(t.numel() for _, t in tensors)
    if total <= MAX_TINY_PARAMETERS:
        return ""
    name, largest = max(tensors, key=lambda item: item[1].numel())
    return f"{total / 1e6:.0f}M parameters and buffers (the largest: {name} {tuple(largest.shape)})"


def _saved_rotary_dim(saved: Mapping[str, Any]) -> int:
    """The rotary part of a head of ``saved``: the head size times its partial_rotary_factor (1 where none)."""
    rope = saved.get("rope_parameters") or {}
    return int((_head_size(saved) or 0) * rope.get("partial_rotary_factor", saved.get("partial_rotary_factor", 1.0)))


# Fields of the hub checkpoints' config schema that transformers' config class dropped or renamed (it converts them
# when it reads a hub config.json, and writes its own names), which vLLM's model of that model_type reads, by
# model_type: each derived from what transformers wrote, or what transformers' modeling hard-codes where the hub's
# config says it (HY V3's and MiniMax-M2's sigmoid routing with a score-correction bias, normalized top-k; HY V3's
# and LongCat-Flash's QK norm and MLA LoRA scales, its identity zero experts). vLLM's name in the comment of each.
HUB_SCHEMA: dict[str, dict[str, Callable[[Mapping[str, Any]], Any]]] = {
    "glm4_moe": {"head_dim": _head_size},  # glm4_moe.py: head_dim=config.head_dim
    "hy_v3": {"expert_hidden_dim": lambda s: s["moe_intermediate_size"], "route_norm": lambda s: True,
              "qk_norm": lambda s: True},
    "afmoe": {"score_func": lambda s: "sigmoid", "route_norm": lambda s: True, "n_group": lambda s: 1,
              "topk_group": lambda s: 1},
    "minimax_m2": {"rotary_dim": _saved_rotary_dim, "scoring_func": lambda s: "sigmoid",
                   "use_routing_bias": lambda s: True},
    "lfm2": {"block_dim": lambda s: s["hidden_size"], "conv_dim": lambda s: s["hidden_size"]},
    "longcat_flash": {"mla_scale_q_lora": lambda s: True, "mla_scale_kv_lora": lambda s: True,
                      "zero_expert_type": lambda s: "identity"},
    # Sarvam's MLA checkpoints give head_dim as the MLA head vLLM's MLA backends read, kv_lora_rank + qk_rope_head_dim
    # (576); vLLM does not count sarvam_mla among its MLA model types, so its ModelConfig takes the head size from it
    "sarvam_mla": {"head_dim": lambda s: s["kv_lora_rank"] + s["qk_rope_head_dim"]},
}


def hub_fields(saved: Mapping[str, Any]) -> dict[str, Any]:
    """Fields of the hub checkpoints' config schema that transformers' config class replaced, derived from what it
    wrote, for the vLLM models that read the hub's names: HUB_SCHEMA's of the model_type, and ``mlp_layer_types`` of
    dense layers, then sparse (MoE) ones as the hub's ``first_k_dense_replace`` (every layer after them MoE:
    ``moe_layer_freq`` 1; GLM-4.7-Flash's Glm4MoeLiteConfig). transformers keeps them as extra attributes and
    ignores them; the callers add only those ``saved`` has not."""
    fields = {name: rule(saved) for name, rule in HUB_SCHEMA.get(str(saved.get("model_type")), {}).items()}
    mlp = saved.get("mlp_layer_types")
    if not isinstance(mlp, list):
        return fields
    dense = next((i for i, kind in enumerate(mlp) if kind != "dense"), len(mlp))
    if not all(kind == "sparse" for kind in mlp[dense:]):
        return fields
    return {**fields, "first_k_dense_replace": dense, "moe_layer_freq": 1}


def _save_without_progress_bar(model: Any, path: Path) -> None:
    """``model.save_pretrained`` with transformers' progress bar off. Its tqdm bar creates tqdm's class-wide
    ``multiprocessing.RLock`` from multiprocessing's default context, which in a check child (a forkserver child)
    is a named semaphore registered with the resource tracker; the child leaves by ``os._exit``, so nothing
    unlinks it and every run that made a checkpoint ended with the tracker's "leaked semaphore objects"."""
    from transformers.utils import logging as hf_logging

    enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        model.save_pretrained(path, safe_serialization=True)
    finally:
        if enabled:
            hf_logging.enable_progress_bar()


CHECKPOINTS_DIR = "vllm-checkpoints"  # in the session's workdir: the tiny checkpoints the checker wrote


def is_tiny_checkpoint(path: str | Path, workdir: str) -> bool:
    """Whether ``path`` is (in) a tiny checkpoint the checker wrote in ``workdir`` (``tiny_checkpoint``)."""
    return (Path(workdir) / CHECKPOINTS_DIR).resolve() in Path(path).resolve().parents


@contextlib.contextmanager
def _one_torch_thread() -> Iterator[None]:
    """torch on one intra-op thread meanwhile. The check child that makes a checkpoint then forks vLLM's ranks
    (engine.py), and a fork of a process whose OpenMP pool ran deadlocks in its first parallel torch op: a tensor
    above ATen's grain size (32768 elements: a vision patch embedding, an audio encoder's 1500 positions) starts
    that pool, and rank 0 hung in the rotary cache of PaliGemma's text model until the check's timeout."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def made_once(path: Path, marker: str, make: Callable[[Path], object]) -> Path:
    """``path``, made by ``make(dir)`` in a temp dir beside it and renamed into place, once: the processes of a
    session (pytest-xdist workers, check children) share it, the first rename wins, and ``path / marker`` exists
    only when it is whole."""
    if (path / marker).exists():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=path.parent, prefix=f".{path.name}-"))
    try:
        make(tmp)
        os.replace(tmp, path)
    except OSError:  # another process of this session made it first
        if not (path / marker).exists():
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return path


def tiny_checkpoint(architecture: str, workdir: str, model_cls: type | None = None) -> Path:
    """The architecture's tiny checkpoint under ``workdir``, made once (``made_once``); where none can be made, the
    reason is kept beside it, so the session's other items skip at once instead of trying again (a vLLM-side
    attempt costs a fork that builds vLLM's model)."""

    def make(tmp: Path) -> None:
        with _one_torch_thread():
            make_tiny_checkpoint(architecture, tmp, model_cls)

    path = Path(workdir) / CHECKPOINTS_DIR / architecture
    refused = path.with_name(f".{architecture}.no-tiny-checkpoint")
    if refused.exists():
        raise NoTinyCheckpoint(refused.read_text())
    try:
        return made_once(path, "config.json", make)
    except NoTinyCheckpoint as e:
        partial = refused.with_name(f"{refused.name}.{os.getpid()}")
        partial.write_text(str(e))
        partial.replace(refused)  # whole or not at all: another process may read it now
        raise
