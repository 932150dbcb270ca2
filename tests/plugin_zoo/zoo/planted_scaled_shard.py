"""A planted sharding bug too small to change a greedy token: at TP>1, rank 1's input columns of layer 1's
row-parallel o_proj come out 1 % too large (as a loader that applies a per-shard scale to the wrong shard would).
The tiny model's nearly flat output distribution keeps every greedy token of TP=2 equal to TP=1's, so a load check
that compares tokens alone passes it; its hooked forward differs from TP=1's from that o_proj on."""

from __future__ import annotations

from collections.abc import Iterable
from typing import ClassVar

import torch

from engine_ref.distributed.parallel_state import get_tp_group
from engine_ref.model_executor.model_loader.weight_utils import CheckpointTensor
from engine_ref.model_executor.models.llama import LlamaForCausalLM

SCALE = 1.01


class ScaledShardLlamaForCausalLM(LlamaForCausalLM):
    example_config: ClassVar[dict] = {**LlamaForCausalLM.example_config,
                                      "architectures": ["ScaledShardLlamaForCausalLM"]}

    def load_weights(self, weights: Iterable[tuple[str, CheckpointTensor]]) -> set[str]:
        loaded = super().load_weights(weights)
        group = get_tp_group()
        weight = self.get_parameter("model.layers.1.self_attn.o_proj.weight")
        if group.world_size > 1 and group.rank_in_group == 1 and weight.is_floating_point():  # the bug: rank 1's
            with torch.no_grad():  # shard, scaled (a pre-quantized int8 weight is left alone: the bug is unquantized)
                weight.mul_(SCALE)
        return loaded
