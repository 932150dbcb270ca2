"""Linear layers for tensor parallelism (vLLM's names; gpt-fast's vocabulary in the comments).

- ColumnParallelLinear ("colwise"): each rank holds ``output_size / tp`` rows of the weight.
- MergedColumnParallelLinear: several column-parallel outputs stacked (gate_proj + up_proj).
- QKVParallelLinear: q, k and v heads stacked; KV heads are replicated when tp > num_kv_heads.
- RowParallelLinear ("rowwise"): each rank holds ``input_size / tp`` columns; outputs are summed.
- ReplicatedLinear: every rank holds everything (routers, the vision tower).

Every parameter carries ``weight_loader`` and ``checkpoint_shapes`` (see weight_utils): the
loader checks the full checkpoint shape, then reads only this rank's rows or columns.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine_ref.distributed.parallel_state import get_tp_group
from engine_ref.model_executor.model_loader.weight_utils import (
    CheckpointTensor,
    ShardId,
    check_shape,
    copy_into,
    default_weight_loader,
    set_weight_attrs,
)
from engine_ref.utils import divide


def _load_rows(param: nn.Parameter, loaded: CheckpointTensor, dim: int, param_offset: int, size: int,
               loaded_start: int) -> None:
    """Copy ``loaded[loaded_start:loaded_start+size]`` along ``dim`` into ``param[param_offset:...]``."""
    target = param.data.narrow(dim, param_offset, size)
    copy_into(target, loaded.narrow(dim, loaded_start, size).load(), loaded.name)


class ReplicatedLinear(nn.Module):
    """y = xW^T + b with the whole weight on every rank."""

    def __init__(self, input_size: int, output_size: int, bias: bool = True) -> None:
        super().__init__()
        self.input_size, self.output_size = input_size, output_size
        self.weight = nn.Parameter(torch.empty(output_size, input_size), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(output_size), requires_grad=False) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class ColumnParallelLinear(nn.Module):
    """y_rank = x W_rank^T + b_rank: each rank computes ``output_size / tp`` of the outputs."""

    def __init__(self, input_size: int, output_size: int, bias: bool = True) -> None:
        super().__init__()
        tp = get_tp_group()
        self.tp_rank, self.tp_size = tp.rank_in_group, tp.world_size
        self.input_size, self.output_size = input_size, output_size
        self.output_size_per_partition = divide(output_size, self.tp_size)
        self.weight = nn.Parameter(torch.empty(self.output_size_per_partition, input_size), requires_grad=False)
        set_weight_attrs(self.weight, output_dim=0, weight_loader=self.weight_loader,
                         checkpoint_shapes={None: (output_size, input_size)})
        if bias:
            self.bias = nn.Parameter(torch.empty(self.output_size_per_partition), requires_grad=False)
            set_weight_attrs(self.bias, output_dim=0, weight_loader=self.weight_loader,
                             checkpoint_shapes={None: (output_size,)})
        else:
            self.bias = None

    def weight_loader(self, param: nn.Parameter, loaded: CheckpointTensor, shard_id: ShardId = None) -> None:
        check_shape(loaded.name, loaded, param.checkpoint_shapes[None])
        size = param.shape[0]
        _load_rows(param, loaded, 0, 0, size, self.tp_rank * size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Column-parallel outputs of several checkpoint tensors stacked in one weight (shard ids 0, 1...)."""

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = True) -> None:
        super().__init__(input_size, sum(output_sizes), bias)
        self.output_sizes = output_sizes
        for param in self.parameters():
            trailing = tuple(param.checkpoint_shapes[None][1:])
            param.checkpoint_shapes = {i: (size, *trailing) for i, size in enumerate(output_sizes)}

    def weight_loader(self, param: nn.Parameter, loaded: CheckpointTensor, shard_id: ShardId = None) -> None:
        check_shape(loaded.name, loaded, param.checkpoint_shapes[shard_id])
        size = divide(self.output_sizes[shard_id], self.tp_size)
        offset = divide(sum(self.output_sizes[:shard_id]), self.tp_size)
        _load_rows(param, loaded, 0, offset, size, self.tp_rank * size)


class QKVParallelLinear(ColumnParallelLinear):
    """q, k and v projections in one column-parallel weight; shard ids "q", "k", "v".

    Each rank holds ``num_heads / tp`` query heads. KV heads are split the same way, or, when
    there are fewer KV heads than ranks, each KV head is replicated on ``tp / num_kv_heads`` ranks.
    """

    def __init__(self, hidden_size: int, head_size: int, total_num_heads: int, total_num_kv_heads: int,
                 bias: bool = False) -> None:
        tp_size = get_tp_group().world_size
        self.head_size = head_size
        self.total_num_heads, self.total_num_kv_heads = total_num_heads, total_num_kv_heads
        self.num_heads = divide(total_num_heads, tp_size)
        if tp_size >= total_num_kv_heads:
            self.num_kv_heads, self.num_kv_head_replicas = 1, divide(tp_size, total_num_kv_heads)
        else:
            self.num_kv_heads, self.num_kv_head_replicas = divide(total_num_kv_heads, tp_size), 1
        output_size = (self.num_heads + 2 * self.num_kv_heads) * head_size * tp_size
        super().__init__(hidden_size, output_size, bias)
        q_size, kv_size = total_num_heads * head_size, total_num_kv_heads * head_size
        for param in self.parameters():
            trailing = tuple(param.checkpoint_shapes[None][1:])
            param.checkpoint_shapes = {"q": (q_size, *trailing), "k": (kv_size, *trailing),
                                       "v": (kv_size, *trailing)}

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_size

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_size

    def weight_loader(self, param: nn.Parameter, loaded: CheckpointTensor, shard_id: ShardId = None) -> None:
        check_shape(loaded.name, loaded, param.checkpoint_shapes[shard_id])
        kv_rank = self.tp_rank // self.num_kv_head_replicas
        offset, size, start = {
            "q": (0, self.q_size, self.tp_rank * self.q_size),
            "k": (self.q_size, self.kv_size, kv_rank * self.kv_size),
            "v": (self.q_size + self.kv_size, self.kv_size, kv_rank * self.kv_size),
        }[shard_id]
        _load_rows(param, loaded, 0, offset, size, start)


class RowParallelLinear(nn.Module):
    """y = sum over ranks of x_rank W_rank^T, + b: each rank holds ``input_size / tp`` input columns."""

    def __init__(self, input_size: int, output_size: int, bias: bool = True, reduce_results: bool = True) -> None:
        super().__init__()
        tp = get_tp_group()
        self.tp_rank, self.tp_size = tp.rank_in_group, tp.world_size
        self.input_size, self.output_size = input_size, output_size
        self.input_size_per_partition = divide(input_size, self.tp_size)
        self.reduce_results = reduce_results
        self.weight = nn.Parameter(torch.empty(output_size, self.input_size_per_partition), requires_grad=False)
        set_weight_attrs(self.weight, input_dim=1, weight_loader=self.weight_loader,
                         checkpoint_shapes={None: (output_size, input_size)})
        if bias:
            self.bias = nn.Parameter(torch.empty(output_size), requires_grad=False)
            set_weight_attrs(self.bias, weight_loader=default_weight_loader)
        else:
            self.bias = None

    def weight_loader(self, param: nn.Parameter, loaded: CheckpointTensor, shard_id: ShardId = None) -> None:
        check_shape(loaded.name, loaded, param.checkpoint_shapes[None])
        size = param.shape[1]
        _load_rows(param, loaded, 1, 0, size, self.tp_rank * size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.linear(x, self.weight)
        if self.reduce_results:
            out = get_tp_group().all_reduce(out)
        return out if self.bias is None else out + self.bias
