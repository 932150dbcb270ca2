"""Which of a model's modules LoRA can wrap, under the names PEFT gives them."""

from __future__ import annotations

from torch import nn

from engine_ref.lora.layers import lora_layer_cls
from engine_ref.model_executor.model_loader.weight_utils import ShardId, WeightsMapper

LoRATargets = dict[str, tuple[str, ShardId]]


def lora_targets(model: nn.Module) -> LoRATargets:
    """``{PEFT module name: (the model's module, sub-projection)}`` for every module LoRA can wrap.

    PEFT names the checkpoint's (transformers') modules, ``model.layers.0.self_attn.q_proj``; the
    model's weights mapper (its packed modules mapping: q_proj -> qkv_proj shard "q") gives each
    the module and sub-projection it lives in, e.g. ``("model.layers.0.self_attn.qkv_proj", "q")``.
    """
    mapper: WeightsMapper = getattr(model, "weights_mapper", WeightsMapper())
    return {
        mapper.to_checkpoint(f"{name}.weight", shard_id).removesuffix(".weight"): (name, shard_id)
        for name, module in model.named_modules()
        if lora_layer_cls(module) is not None
        for shard_id in module.output_shards
    }
