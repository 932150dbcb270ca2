"""Mixture of experts: top-k routing and the experts' weights, sharded for tensor parallelism.

Each rank holds every expert, with ``intermediate_size / tp`` of each expert's hidden units
(gate and up rows, down columns), so the experts' outputs are partial sums reduced over ranks.

Device capability is asked lazily, in ``_gpu_computes_bf16``, the first time an expert runs on a
GPU, and cached. Asking at import time (``torch.cuda.get_device_capability()`` in module scope)
initializes CUDA in every process that imports the model: the registry's inspection child, every
forked worker. That is the bug this module's shape exists to avoid.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from engine_ref.distributed.parallel_state import get_tp_group
from engine_ref.model_executor.layers.linear import ReplicatedLinear
from engine_ref.model_executor.layers.quantization.base_config import (
    FusedMoEMethodBase,
    check_checkpoint_dtype,
    select_quant_method,
)
from engine_ref.model_executor.model_loader.weight_utils import (
    CheckpointTensor,
    check_shape,
    checkpoint_shapes,
    copy_into,
    param_dim,
    set_weight_attrs,
)
from engine_ref.utils import divide

if TYPE_CHECKING:
    from engine_ref.model_executor.layers.quantization.base_config import QuantizationConfig


@functools.cache
def _gpu_computes_bf16(device_index: int) -> bool:
    """Whether the GPU has native bfloat16 matmuls (compute capability 8.0+). Lazy and cached."""
    major, _ = torch.cuda.get_device_capability(device_index)
    return major >= 8


def expert_compute_dtype(x: torch.Tensor) -> torch.dtype:
    """bfloat16 experts run in float32 on GPUs older than Ampere; everything else in its own dtype."""
    if x.device.type == "cuda" and x.dtype == torch.bfloat16 and not _gpu_computes_bf16(x.device.index or 0):
        return torch.float32
    return x.dtype


def select_experts(router_logits: torch.Tensor, top_k: int, renormalize: bool
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax over experts (float32), keep the top k, optionally renormalize them to sum to 1."""
    probs = F.softmax(router_logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def fused_experts(hidden_states: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                  expert_weights: Callable[[int, torch.dtype], tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """Each token through its top-k experts, weighted; ``expert_weights(e, dtype)`` gives (w13, w2) of e."""
    dtype = expert_compute_dtype(hidden_states)
    out = torch.zeros_like(hidden_states)
    for expert in topk_ids.unique().tolist():
        tokens, slot = torch.where(topk_ids == expert)
        w13, w2 = expert_weights(expert, dtype)
        gate, up = F.linear(hidden_states[tokens].to(dtype), w13).chunk(2, dim=-1)
        y = F.linear(F.silu(gate) * up, w2)
        out.index_add_(0, tokens, (y * topk_weights[tokens, slot, None]).to(out.dtype))
    return out


class UnquantizedFusedMoEMethod(FusedMoEMethodBase):
    """The experts' weights in the model dtype."""

    def create_weights(self, layer: FusedMoE) -> None:
        shard = layer.intermediate_size_per_partition
        w13 = nn.Parameter(torch.empty(layer.num_experts, 2 * shard, layer.hidden_size), requires_grad=False)
        w2 = nn.Parameter(torch.empty(layer.num_experts, layer.hidden_size, shard), requires_grad=False)
        set_weight_attrs(w13, weight_loader=layer.weight_loader,
                         checkpoint_shapes=layer.shard_shapes("w13", layer.hidden_size))
        set_weight_attrs(w2, input_dim=1, weight_loader=layer.weight_loader,
                         checkpoint_shapes=layer.shard_shapes("w2", layer.intermediate_size))
        layer.register_parameter("w13_weight", w13)
        layer.register_parameter("w2_weight", w2)

    def apply(self, layer: FusedMoE, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
              ) -> torch.Tensor:
        return fused_experts(x, topk_weights, topk_ids,
                             lambda e, dtype: (layer.w13_weight[e].to(dtype), layer.w2_weight[e].to(dtype)))


class FusedMoE(nn.Module):
    """The experts of one MoE layer: w13 (gate and up, stacked) and w2 (down) for every expert.

    Its quant method (``quant_config.get_quant_method(layer, prefix)``) creates the parameters;
    ``input_dim`` on a parameter says its per-expert dim 1 follows the down projection's input.
    """

    w13_weight: nn.Parameter  # registered by the quant method
    w2_weight: nn.Parameter

    def __init__(self, num_experts: int, top_k: int, hidden_size: int, intermediate_size: int,
                 renormalize: bool = True, quant_config: QuantizationConfig | None = None, prefix: str = ""
                 ) -> None:
        super().__init__()
        tp = get_tp_group()
        self.tp_rank, self.tp_size = tp.rank_in_group, tp.world_size
        self.num_experts, self.top_k, self.renormalize = num_experts, top_k, renormalize
        self.hidden_size, self.intermediate_size = hidden_size, intermediate_size
        self.intermediate_size_per_partition = divide(intermediate_size, self.tp_size)
        self.prefix = prefix
        self.quant_method = select_quant_method(quant_config, self, prefix, FusedMoEMethodBase,
                                                UnquantizedFusedMoEMethod)
        self.quant_method.create_weights(self)

    def shard_shapes(self, param: str, *trailing: int) -> dict[tuple[int, str], tuple[int, ...]]:
        """Full checkpoint shape of each per-expert tensor of ``w13`` or ``w2``: ``(rows, *trailing)``."""
        if param == "w2":
            return {(e, "down"): (self.hidden_size, *trailing) for e in range(self.num_experts)}
        return {(e, which): (self.intermediate_size, *trailing)
                for e in range(self.num_experts) for which in ("gate", "up")}

    @staticmethod
    def make_expert_params_mapping(gate: str, down: str, up: str, num_experts: int
                                   ) -> list[tuple[str, str, tuple[int, str]]]:
        """WeightsMapper entries for per-expert checkpoint tensors, e.g. ``experts.3.w1.weight``.

        Their scales map along: ``experts.3.w1.weight_scale`` loads ``experts.w13_weight_scale``.
        """
        return [
            (param, f"experts.{e}.{name}.weight", (e, which))
            for e in range(num_experts)
            for param, name, which in (("experts.w13_weight", gate, "gate"), ("experts.w13_weight", up, "up"),
                                       ("experts.w2_weight", down, "down"))
        ]

    def weight_loader(self, param: nn.Parameter, loaded: CheckpointTensor, shard_id: tuple[int, str]) -> None:
        check_shape(loaded.name, loaded, checkpoint_shapes(param)[shard_id])
        expert, which = shard_id
        shard = self.intermediate_size_per_partition
        start = self.tp_rank * shard
        if which == "down":
            target = param.data[expert]
            input_dim = param_dim(param, "input_dim")
            if input_dim is not None:
                loaded = loaded.narrow(input_dim, start, shard)
        else:
            offset = 0 if which == "gate" else shard
            target = param.data[expert, offset:offset + shard]
            loaded = loaded.narrow(0, start, shard)
        tensor = loaded.load()
        check_checkpoint_dtype(param, tensor, loaded.name)
        copy_into(target, tensor, loaded.name)

    def forward(self, hidden_states: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        weights, ids = select_experts(router_logits, self.top_k, self.renormalize)
        return get_tp_group().all_reduce(self.quant_method.apply(self, hidden_states, weights, ids))


class SparseMoeBlock(nn.Module):
    """A router (replicated, never quantized, as in vLLM) choosing ``top_k`` of ``num_experts`` experts."""

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, intermediate_size: int,
                 renormalize: bool, quant_config: QuantizationConfig | None = None, prefix: str = "") -> None:
        super().__init__()
        self.gate = ReplicatedLinear(hidden_size, num_experts, bias=False)
        self.experts = FusedMoE(num_experts, top_k, hidden_size, intermediate_size, renormalize,
                                quant_config, f"{prefix}.experts")

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.experts(hidden_states, router_logits=self.gate(hidden_states))
