"""A written tiny checkpoint brought to the hub checkpoints' layout: their tensor names, norms and config fields
where transformers' writer or config class differs from what vLLM's model reads.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

from pytest_enginecheck.targets.vllm.checkpoints.shrink import head_size


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


def _saved_rotary_dim(saved: Mapping[str, Any]) -> int:
    """The rotary part of a head of ``saved``: the head size times its partial_rotary_factor (1 where none)."""
    rope = saved.get("rope_parameters") or {}
    return int((head_size(saved) or 0) * rope.get("partial_rotary_factor", saved.get("partial_rotary_factor", 1.0)))


# Fields of the hub checkpoints' config schema that transformers' config class dropped or renamed (it converts them
# when it reads a hub config.json, and writes its own names), which vLLM's model of that model_type reads, by
# model_type: each derived from what transformers wrote, or what transformers' modeling hard-codes where the hub's
# config says it (HY V3's and MiniMax-M2's sigmoid routing with a score-correction bias, normalized top-k; HY V3's
# and LongCat-Flash's QK norm and MLA LoRA scales, its identity zero experts). vLLM's name in the comment of each.
HUB_SCHEMA: dict[str, dict[str, Callable[[Mapping[str, Any]], Any]]] = {
    "glm4_moe": {"head_dim": head_size},  # glm4_moe.py: head_dim=config.head_dim
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
