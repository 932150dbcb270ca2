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

import torch
import torch.nn.functional as F
from torch import nn

from engine_ref.distributed.parallel_state import get_tp_group
from engine_ref.model_executor.layers.linear import ReplicatedLinear
from engine_ref.model_executor.model_loader.weight_utils import (
    CheckpointTensor,
    check_shape,
    copy_into,
    set_weight_attrs,
)
from engine_ref.utils import divide


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


class FusedMoE(nn.Module):
    """The experts of one MoE layer: w13 (gate and up, stacked) and w2 (down) for every expert."""

    def __init__(self, num_experts: int, top_k: int, hidden_size: int, intermediate_size: int,
                 renormalize: bool = True) -> None:
        super().__init__()
        tp = get_tp_group()
        self.tp_rank, self.tp_size = tp.rank_in_group, tp.world_size
        self.num_experts, self.top_k, self.renormalize = num_experts, top_k, renormalize
        self.intermediate_size_per_partition = shard = divide(intermediate_size, self.tp_size)
        self.w13_weight = nn.Parameter(torch.empty(num_experts, 2 * shard, hidden_size), requires_grad=False)
        self.w2_weight = nn.Parameter(torch.empty(num_experts, hidden_size, shard), requires_grad=False)
        full = (intermediate_size, hidden_size)
        set_weight_attrs(self.w13_weight, weight_loader=self.weight_loader, checkpoint_shapes={
            (e, which): full for e in range(num_experts) for which in ("gate", "up")})
        set_weight_attrs(self.w2_weight, weight_loader=self.weight_loader, checkpoint_shapes={
            (e, "down"): full[::-1] for e in range(num_experts)})

    @staticmethod
    def make_expert_params_mapping(gate: str, down: str, up: str, num_experts: int
                                   ) -> list[tuple[str, str, tuple[int, str]]]:
        """WeightsMapper entries for per-expert checkpoint tensors, e.g. ``experts.3.w1.weight``."""
        return [
            (param, f"experts.{e}.{name}.weight", (e, which))
            for e in range(num_experts)
            for param, name, which in (("experts.w13_weight", gate, "gate"), ("experts.w13_weight", up, "up"),
                                       ("experts.w2_weight", down, "down"))
        ]

    def weight_loader(self, param: nn.Parameter, loaded: CheckpointTensor, shard_id: tuple[int, str]) -> None:
        check_shape(loaded.name, loaded, param.checkpoint_shapes[shard_id])
        expert, which = shard_id
        shard = self.intermediate_size_per_partition
        start = self.tp_rank * shard
        if which == "down":
            copy_into(param.data[expert], loaded.narrow(1, start, shard).load(), loaded.name)
        else:
            offset = 0 if which == "gate" else shard
            copy_into(param.data[expert, offset:offset + shard], loaded.narrow(0, start, shard).load(), loaded.name)

    def forward(self, hidden_states: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        weights, ids = select_experts(router_logits, self.top_k, self.renormalize)
        dtype = expert_compute_dtype(hidden_states)
        out = torch.zeros_like(hidden_states)
        for expert in ids.unique().tolist():
            tokens, slot = torch.where(ids == expert)
            x = hidden_states[tokens].to(dtype)
            gate, up = F.linear(x, self.w13_weight[expert].to(dtype)).chunk(2, dim=-1)
            y = F.linear(F.silu(gate) * up, self.w2_weight[expert].to(dtype))
            out.index_add_(0, tokens, (y * weights[tokens, slot, None]).to(out.dtype))
        return get_tp_group().all_reduce(out)


class SparseMoeBlock(nn.Module):
    """A router (replicated) choosing ``top_k`` of ``num_experts`` experts for each token."""

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, intermediate_size: int,
                 renormalize: bool) -> None:
        super().__init__()
        self.gate = ReplicatedLinear(hidden_size, num_experts, bias=False)
        self.experts = FusedMoE(num_experts, top_k, hidden_size, intermediate_size, renormalize)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.experts(hidden_states, router_logits=self.gate(hidden_states))
