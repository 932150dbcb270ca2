"""``...WithLoRA``: parallel linear layers with ``max_loras`` slots of LoRA A and B (vLLM's layers).

A wrapper holds its base layer (composition: the base layer's weights, quant method and forward)
and adds ``x @ A^T @ B^T`` (B already scaled) for each token whose slot the batch's LoRAMapping
names. A and B split over ranks the way the base layer's weight does:

- column-parallel: A whole, B split along the output. A packed layer (``qkv_proj``,
  ``gate_up_proj``) holds one A block and one B block per sub-projection (its ``output_shards``),
  B's block at the rows of this rank's output where the base layer loads that sub-projection.
- row-parallel: A split along the input, B whole. The partial products are added before the
  layer's all-reduce, so they ride on it.

Slots are preallocated, zero-padded to ``max_lora_rank``, as non-persistent buffers named
``lora_a_stacked`` / ``lora_b_stacked``: the memory vLLM reserves at startup.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from engine_ref.distributed.parallel_state import get_tp_group
from engine_ref.model_executor.layers.linear import ColumnParallelLinear, LinearBase, RowParallelLinear
from engine_ref.model_executor.model_loader.weight_utils import CheckpointTensor, ShardId


@dataclass
class LoRAMapping:
    """The slot of every token of the current batch, shared by all wrapped layers of a model.

    ``rows_by_slot`` maps each slot in use to its token rows; empty means no LoRA in this batch.
    """

    rows_by_slot: dict[int, torch.Tensor] = field(default_factory=dict)

    def set(self, token_slots: torch.Tensor) -> None:
        """``token_slots[i]`` is token i's slot, -1 for none."""
        self.rows_by_slot = {slot: torch.where(token_slots == slot)[0]
                             for slot in token_slots.unique().tolist() if slot >= 0}


class BaseLinearLayerWithLoRA(nn.Module):
    """The slots of a wrapped linear layer, how its adapters shard, and the LoRA product."""

    lora_a_stacked: torch.Tensor  # [max_loras, sub-projections * max_lora_rank, input columns of this rank]
    lora_b_stacked: torch.Tensor  # [max_loras, output rows of this rank, max_lora_rank]

    def __init__(self, base_layer: LinearBase, max_loras: int, max_lora_rank: int, dtype: torch.dtype,
                 device: torch.device, mapping: LoRAMapping) -> None:
        super().__init__()
        self.base_layer, self.mapping, self.max_lora_rank = base_layer, mapping, max_lora_rank
        self.shard_ids: list[ShardId] = list(base_layer.output_shards)
        a_shape = (max_loras, len(self.shard_ids) * max_lora_rank, base_layer.input_size_per_partition)
        b_shape = (max_loras, base_layer.output_size_per_partition, max_lora_rank)
        self.register_buffer("lora_a_stacked", torch.zeros(a_shape, dtype=dtype, device=device), persistent=False)
        self.register_buffer("lora_b_stacked", torch.zeros(b_shape, dtype=dtype, device=device), persistent=False)

    def full_shapes(self, shard_id: ShardId, r: int) -> tuple[tuple[int, int], tuple[int, int]]:
        """The shapes of A and B in the adapter file for sub-projection ``shard_id`` at rank ``r``."""
        return (r, self.base_layer.input_size), (self.base_layer.output_shards[shard_id], r)

    def slice_lora_a(self, lora_a: CheckpointTensor) -> CheckpointTensor:
        """The columns of A this rank holds: the base layer's input columns."""
        return lora_a.narrow(1, self.base_layer.input_start, self.base_layer.input_size_per_partition)

    def slice_lora_b(self, lora_b: CheckpointTensor, shard_id: ShardId) -> CheckpointTensor:
        """The rows of B this rank holds: the base layer's rows of sub-projection ``shard_id``."""
        _, size, start = self.base_layer.output_shard(shard_id)
        return lora_b.narrow(0, start, size)

    def set_lora(self, slot: int, weights: dict[ShardId, tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Fill ``slot`` with this rank's (A, scaled B) per sub-projection; absent ones stay zero."""
        self.reset_lora(slot)
        r_max = self.max_lora_rank
        for shard_id, (lora_a, lora_b) in weights.items():
            i, r = self.shard_ids.index(shard_id), lora_a.shape[0]
            offset, size, _ = self.base_layer.output_shard(shard_id)
            self.lora_a_stacked[slot, i * r_max:i * r_max + r].copy_(lora_a)
            self.lora_b_stacked[slot, offset:offset + size, :r].copy_(lora_b)

    def reset_lora(self, slot: int) -> None:
        self.lora_a_stacked[slot].zero_()
        self.lora_b_stacked[slot].zero_()

    def add_lora(self, output: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """``output`` plus each token's LoRA product, in place."""
        r = self.max_lora_rank
        for slot, rows in self.mapping.rows_by_slot.items():
            shrunk = F.linear(x[rows].to(self.lora_a_stacked.dtype), self.lora_a_stacked[slot])
            delta = torch.empty(len(rows), output.shape[-1], dtype=shrunk.dtype, device=shrunk.device)
            for i, shard_id in enumerate(self.shard_ids):
                offset, size, _ = self.base_layer.output_shard(shard_id)
                delta[:, offset:offset + size] = F.linear(shrunk[:, i * r:(i + 1) * r],
                                                          self.lora_b_stacked[slot, offset:offset + size])
            output.index_add_(0, rows, delta.to(output.dtype))
        return output


class ColumnParallelLinearWithLoRA(BaseLinearLayerWithLoRA):
    """Column-parallel (also packed qkv_proj / gate_up_proj): A whole, B split along the output."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        output = self.base_layer(x)
        return self.add_lora(output, x) if self.mapping.rows_by_slot else output


class RowParallelLinearWithLoRA(BaseLinearLayerWithLoRA):
    """Row-parallel: A split along the input, B whole; the partial sums share the layer's all-reduce."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        base = self.base_layer
        output = base.quant_method.apply(base, x)
        if self.mapping.rows_by_slot:
            output = self.add_lora(output, x)
        if base.reduce_results:
            output = get_tp_group().all_reduce(output)
        return output if base.bias is None else output + base.bias


def lora_layer_cls(layer: nn.Module) -> type[BaseLinearLayerWithLoRA] | None:
    """The ``...WithLoRA`` class that wraps ``layer``, or None when LoRA cannot wrap it."""
    if isinstance(layer, ColumnParallelLinear):
        return ColumnParallelLinearWithLoRA
    if isinstance(layer, RowParallelLinear):
        return RowParallelLinearWithLoRA
    return None
