"""The process groups a worker joins, and the tensor-parallel group the layers talk through.

vLLM's parallel_state, reduced to tensor parallelism. A worker calls ``init_distributed_environment``
once: it joins the engine's world process group (gloo on CPU, nccl on CUDA) and builds the TP group
from it (here every rank of the engine is in the one TP group). The layers read ``get_tp_group()``
when they are built and use its collectives in ``forward``.

Each engine rendezvouses through its own ``distributed_init_method`` (the executor's private
``file://`` store), so two engines in one process tree, or in two test workers, never meet.

Without a process group the TP group is *simulated* (``tensor_parallel_state``): a rank builds
exactly its shard and collectives only produce the right shapes. That is how the memory estimate
builds rank r of a TP=N model on the meta device in one process.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist


@dataclass
class GroupCoordinator:
    """A rank's view of one process group and the collectives the layers need.

    ``device_group`` carries tensors on the model's device (nccl on CUDA, gloo on CPU);
    ``cpu_group`` (gloo) carries small host-side values such as memory sizes. On CPU they are one group.
    """

    rank_in_group: int = 0
    world_size: int = 1
    device_group: dist.ProcessGroup | None = None
    cpu_group: dist.ProcessGroup | None = None

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
        gathered = [torch.empty_like(input_) for _ in range(self.world_size)]
        local = input_.contiguous()
        if self.device_group is None:  # simulated: the same buffers (so the same memory), filled with copies
            for buffer in gathered:
                buffer.copy_(local)
        else:
            dist.all_gather(gathered, local, group=self.device_group)
        return torch.cat(gathered, dim=dim)

    def all_reduce_max(self, value: int) -> int:
        return self._reduce_int(value, dist.ReduceOp.MAX)

    def all_reduce_min(self, value: int) -> int:
        return self._reduce_int(value, dist.ReduceOp.MIN)

    def _reduce_int(self, value: int, op: dist.ReduceOp.RedOpType) -> int:
        group = self.cpu_group or self.device_group
        if self.world_size == 1 or group is None:
            return value
        t = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(t, op=op, group=group)
        return int(t.item())


_WORLD = GroupCoordinator()
_TP = GroupCoordinator()


def get_world_group() -> GroupCoordinator:
    """Every rank of this engine (rank 0 of 1 outside a multi-rank worker)."""
    return _WORLD


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
    """Join this engine's world group, build the TP group over all its ranks, make it current.

    A collective: every rank of the engine must call it (``timeout_s`` bounds the wait for the others).
    """
    global _WORLD, _TP
    if world_size == 1:
        _WORLD = _TP = GroupCoordinator()
        return _TP
    timeout = timedelta(seconds=timeout_s)
    if not dist.is_initialized():
        dist.init_process_group(backend=backend, init_method=distributed_init_method,
                                world_size=world_size, rank=rank, timeout=timeout)
    world = dist.group.WORLD
    world_cpu = world if backend == "gloo" else dist.new_group(backend="gloo", timeout=timeout)
    _WORLD = GroupCoordinator(rank, world_size, world, world_cpu)
    _TP = initialize_model_parallel(list(range(world_size)), backend, timeout)
    return _TP


def initialize_model_parallel(tp_ranks: list[int], backend: str, timeout: timedelta) -> GroupCoordinator:
    """The TP group over ``tp_ranks`` (a collective over the world group: every rank calls it)."""
    device_group = dist.new_group(tp_ranks, backend=backend, timeout=timeout)
    cpu_group = device_group if backend == "gloo" else dist.new_group(tp_ranks, backend="gloo", timeout=timeout)
    return GroupCoordinator(tp_ranks.index(dist.get_rank()), len(tp_ranks), device_group, cpu_group)


def destroy_distributed_environment() -> None:
    """Leave the process groups (a no-op without them) and reset the world and TP groups."""
    global _WORLD, _TP
    _WORLD = _TP = GroupCoordinator()
    if dist.is_initialized():
        dist.destroy_process_group()
