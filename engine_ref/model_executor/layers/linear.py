"""Linear layers for tensor parallelism (vLLM's names; gpt-fast's vocabulary in the comments).

- ColumnParallelLinear ("colwise"): each rank holds ``output_size / tp`` rows of the weight.
- MergedColumnParallelLinear: several column-parallel outputs stacked (gate_proj + up_proj).
- QKVParallelLinear: q, k and v heads stacked; KV heads are replicated when tp > num_kv_heads.
- RowParallelLinear ("rowwise"): each rank holds ``input_size / tp`` columns; outputs are summed.
- ReplicatedLinear: every rank holds everything (routers, the vision tower).

A layer describes how its rows and columns split over ranks; its quant method (from
``quant_config.get_quant_method(layer, prefix)``, UnquantizedLinearMethod without one) creates
the parameters and computes the output. Every parameter carries ``weight_loader`` and
``checkpoint_shapes`` (see weight_utils); ``output_dim`` / ``input_dim`` say which of its dims
follow the layer's output rows / input columns. The loader checks the full checkpoint shape, then
reads only this rank's rows and columns.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from engine_ref.distributed.parallel_state import get_tp_group
from engine_ref.errors import WeightLoadError
from engine_ref.model_executor.layers.quantization.base_config import (
    LinearMethodBase,
    check_checkpoint_dtype,
    select_quant_method,
)
from engine_ref.model_executor.model_loader.weight_utils import (
    CheckpointTensor,
    ShardId,
    check_shape,
    checkpoint_shapes,
    copy_into,
    default_weight_loader,
    param_dim,
    set_weight_attrs,
)
from engine_ref.utils import divide

if TYPE_CHECKING:
    from engine_ref.model_executor.layers.quantization.base_config import QuantizationConfig


def _load_rows(param: nn.Parameter, loaded: CheckpointTensor, dim: int, param_offset: int, size: int,
               loaded_start: int) -> None:
    """Copy ``loaded[loaded_start:loaded_start+size]`` along ``dim`` into ``param[param_offset:...]``."""
    target = param.data.narrow(dim, param_offset, size)
    tensor = loaded.narrow(dim, loaded_start, size).load()
    check_checkpoint_dtype(param, tensor, loaded.name)
    copy_into(target, tensor, loaded.name)


class UnquantizedLinearMethod(LinearMethodBase):
    """y = xW^T + b with the weight in the model dtype: the plain path the other methods vary."""

    def create_weights(self, layer: LinearBase) -> None:
        weight = nn.Parameter(torch.empty(layer.output_size_per_partition, layer.input_size_per_partition),
                              requires_grad=False)
        set_weight_attrs(weight, output_dim=0, input_dim=1, weight_loader=layer.weight_loader,
                         checkpoint_shapes=layer.shard_shapes(layer.input_size))
        layer.register_parameter("weight", weight)

    def apply(self, layer: LinearBase, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return F.linear(x, layer.weight, bias)


class LinearBase(nn.Module):
    """A linear layer's geometry and weight loader; its quant method owns the weight and the matmul.

    Subclasses set how this rank's rows map to checkpoint rows (``output_shard``), the stacked
    checkpoint tensors (``output_shards``: shard id -> full rows) and the first input column
    this rank holds (``input_start``).
    """

    output_is_sharded: ClassVar[bool] = True
    weight: nn.Parameter  # registered by the quant method

    def __init__(self, input_size: int, output_size: int, input_size_per_partition: int,
                 output_size_per_partition: int, bias: bool, quant_config: QuantizationConfig | None,
                 prefix: str, output_shards: dict[ShardId, int] | None = None) -> None:
        super().__init__()
        tp = get_tp_group()
        self.tp_rank, self.tp_size = tp.rank_in_group, tp.world_size
        self.input_size, self.output_size = input_size, output_size
        self.input_size_per_partition = input_size_per_partition
        self.output_size_per_partition = output_size_per_partition
        self.output_shards = output_shards or {None: output_size}
        self.input_start = 0
        self.prefix = prefix
        self.quant_method = select_quant_method(quant_config, self, prefix, LinearMethodBase, UnquantizedLinearMethod)
        self.quant_method.create_weights(self)
        if not bias:
            self.bias = None
        elif self.output_is_sharded:
            self.bias = nn.Parameter(torch.empty(output_size_per_partition), requires_grad=False)
            set_weight_attrs(self.bias, output_dim=0, weight_loader=self.weight_loader,
                             checkpoint_shapes=self.shard_shapes())
        else:
            self.bias = nn.Parameter(torch.empty(output_size), requires_grad=False)
            set_weight_attrs(self.bias, weight_loader=default_weight_loader)

    def shard_shapes(self, *trailing: int) -> dict[ShardId, tuple[int, ...]]:
        """Full checkpoint shape of each stacked tensor, ``(rows, *trailing)``."""
        return {shard_id: (rows, *trailing) for shard_id, rows in self.output_shards.items()}

    def output_shard(self, shard_id: ShardId) -> tuple[int, int, int]:
        """(first row in this rank's parameter, number of rows, first row in the checkpoint tensor)."""
        return 0, self.output_size, 0

    def weight_loader(self, param: nn.Parameter, loaded: CheckpointTensor, shard_id: ShardId = None) -> None:
        check_shape(loaded.name, loaded, checkpoint_shapes(param)[shard_id])
        input_dim, output_dim = param_dim(param, "input_dim"), param_dim(param, "output_dim")
        if output_dim is None:
            raise WeightLoadError(f"the parameter for {loaded.name!r} has no output_dim; its create_weights must "
                                  f"set_weight_attrs(output_dim=...) for the linear layer's weight_loader")
        if input_dim is not None:
            loaded = loaded.narrow(input_dim, self.input_start, param.shape[input_dim])
        offset, size, start = self.output_shard(shard_id)
        _load_rows(param, loaded, output_dim, offset, size, start)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.quant_method.apply(self, x, self.bias)


class ReplicatedLinear(LinearBase):
    """y = xW^T + b with the whole weight on every rank."""

    output_is_sharded = False

    def __init__(self, input_size: int, output_size: int, bias: bool = True,
                 quant_config: QuantizationConfig | None = None, prefix: str = "") -> None:
        super().__init__(input_size, output_size, input_size, output_size, bias, quant_config, prefix)


class ColumnParallelLinear(LinearBase):
    """y_rank = x W_rank^T + b_rank: each rank computes ``output_size / tp`` of the outputs."""

    def __init__(self, input_size: int, output_size: int, bias: bool = True,
                 quant_config: QuantizationConfig | None = None, prefix: str = "",
                 output_shards: dict[ShardId, int] | None = None) -> None:
        shard = divide(output_size, get_tp_group().world_size)
        super().__init__(input_size, output_size, input_size, shard, bias, quant_config, prefix, output_shards)

    def output_shard(self, shard_id: ShardId) -> tuple[int, int, int]:
        size = self.output_size_per_partition
        return 0, size, self.tp_rank * size


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Column-parallel outputs of several checkpoint tensors stacked in one weight (shard ids 0, 1...)."""

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = True,
                 quant_config: QuantizationConfig | None = None, prefix: str = "") -> None:
        self.output_sizes = output_sizes
        super().__init__(input_size, sum(output_sizes), bias, quant_config, prefix, dict(enumerate(output_sizes)))

    def output_shard(self, shard_id: ShardId) -> tuple[int, int, int]:
        size = divide(self.output_sizes[shard_id], self.tp_size)
        return divide(sum(self.output_sizes[:shard_id]), self.tp_size), size, self.tp_rank * size


class QKVParallelLinear(ColumnParallelLinear):
    """q, k and v projections in one column-parallel weight; shard ids "q", "k", "v".

    Each rank holds ``num_heads / tp`` query heads. KV heads are split the same way, or, when
    there are fewer KV heads than ranks, each KV head is replicated on ``tp / num_kv_heads`` ranks.
    """

    def __init__(self, hidden_size: int, head_size: int, total_num_heads: int, total_num_kv_heads: int,
                 bias: bool = False, quant_config: QuantizationConfig | None = None, prefix: str = "") -> None:
        tp_size = get_tp_group().world_size
        self.head_size = head_size
        self.total_num_heads, self.total_num_kv_heads = total_num_heads, total_num_kv_heads
        self.num_heads = divide(total_num_heads, tp_size)
        if tp_size >= total_num_kv_heads:
            self.num_kv_heads, self.num_kv_head_replicas = 1, divide(tp_size, total_num_kv_heads)
        else:
            self.num_kv_heads, self.num_kv_head_replicas = divide(total_num_kv_heads, tp_size), 1
        output_size = (self.num_heads + 2 * self.num_kv_heads) * head_size * tp_size
        q_size, kv_size = total_num_heads * head_size, total_num_kv_heads * head_size
        super().__init__(hidden_size, output_size, bias, quant_config, prefix,
                         {"q": q_size, "k": kv_size, "v": kv_size})

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_size

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_size

    def output_shard(self, shard_id: ShardId) -> tuple[int, int, int]:
        kv_rank = self.tp_rank // self.num_kv_head_replicas
        return {
            "q": (0, self.q_size, self.tp_rank * self.q_size),
            "k": (self.q_size, self.kv_size, kv_rank * self.kv_size),
            "v": (self.q_size + self.kv_size, self.kv_size, kv_rank * self.kv_size),
        }[shard_id]


class RowParallelLinear(LinearBase):
    """y = sum over ranks of x_rank W_rank^T, + b: each rank holds ``input_size / tp`` input columns."""

    output_is_sharded = False

    def __init__(self, input_size: int, output_size: int, bias: bool = True, reduce_results: bool = True,
                 quant_config: QuantizationConfig | None = None, prefix: str = "") -> None:
        shard = divide(input_size, get_tp_group().world_size)
        self.reduce_results = reduce_results
        super().__init__(input_size, output_size, shard, output_size, bias, quant_config, prefix)
        self.input_start = self.tp_rank * shard

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.quant_method.apply(self, x)
        if self.reduce_results:
            out = get_tp_group().all_reduce(out)
        return out if self.bias is None else out + self.bias
