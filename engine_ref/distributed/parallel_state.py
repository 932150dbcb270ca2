"""The tensor-parallel group each layer talks through (vLLM's parallel_state, reduced to TP).

A worker calls ``init_distributed_environment`` once (gloo on CPU, nccl on CUDA); the layers read
``get_tp_group()`` when they are built and use its collectives in ``forward``. Without a process
group the TP group is *simulated* (``tensor_parallel_state``): a rank builds exactly its shard and
collectives only produce the right shapes. That is how the memory estimate builds rank r of a
TP=N model on the meta device in one process.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass
class GroupCoordinator:
    """A rank's view of its tensor-parallel group and the collectives the layers need."""

    rank_in_group: int = 0
    world_size: int = 1
    device_group: dist.ProcessGroup | None = None

    @property
    def is_simulated(self) -> bool:
        return self.world_size > 1 and self.device_group is None

    def all_reduce(self, input_: torch.Tensor) -> torch.Tensor:
        """Sum over ranks, in place. Row-parallel layers call this on their partial outputs."""
        if self.world_size > 1 and self.device_group is not None:
            dist.all_reduce(input_, group=self.device_group)
        return input_

    def all_gather(self, input_: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Concatenate every rank's tensor along ``dim`` (the vocab shards of the logits)."""
        if self.world_size == 1:
            return input_
        if self.device_group is None:
            return torch.cat([input_] * self.world_size, dim=dim)
        gathered = [torch.empty_like(input_) for _ in range(self.world_size)]
        dist.all_gather(gathered, input_.contiguous(), group=self.device_group)
        return torch.cat(gathered, dim=dim)

    def all_reduce_max(self, value: int) -> int:
        return self._reduce_int(value, dist.ReduceOp.MAX)

    def all_reduce_min(self, value: int) -> int:
        return self._reduce_int(value, dist.ReduceOp.MIN)

    def _reduce_int(self, value: int, op: dist.ReduceOp) -> int:
        if self.world_size == 1 or self.device_group is None:
            return value
        t = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(t, op=op, group=self.device_group)
        return int(t.item())


_TP = GroupCoordinator()


def get_tp_group() -> GroupCoordinator:
    """The current tensor-parallel group (rank 0 of 1 unless a worker or estimate set one)."""
    return _TP


def get_tensor_model_parallel_rank() -> int:
    return _TP.rank_in_group


def get_tensor_model_parallel_world_size() -> int:
    return _TP.world_size


@contextmanager
def tensor_parallel_state(rank: int, world_size: int) -> Iterator[GroupCoordinator]:
    """Build (and run on meta or fake tensors) rank ``rank`` of a TP=``world_size`` model, no processes."""
    global _TP
    previous = _TP
    _TP = GroupCoordinator(rank, world_size, None)
    try:
        yield _TP
    finally:
        _TP = previous


def init_distributed_environment(world_size: int, rank: int, distributed_init_method: str,
                                 backend: str, timeout_s: float = 300.0) -> GroupCoordinator:
    """Join this engine's process group (all its ranks form one TP group) and make it current."""
    global _TP
    if world_size == 1:
        _TP = GroupCoordinator()
        return _TP
    if not dist.is_initialized():
        dist.init_process_group(backend=backend, init_method=distributed_init_method,
                                world_size=world_size, rank=rank, timeout=timedelta(seconds=timeout_s))
    _TP = GroupCoordinator(rank, world_size, dist.group.WORLD)
    return _TP


def destroy_distributed_environment() -> None:
    """Leave the process group (a no-op without one) and reset the TP group."""
    global _TP
    _TP = GroupCoordinator()
    if dist.is_initialized():
        dist.destroy_process_group()
