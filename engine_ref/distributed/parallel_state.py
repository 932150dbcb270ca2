"""The process groups a worker joins, and the tensor-parallel group the layers talk through.

vLLM's parallel_state, reduced to tensor parallelism. A worker calls ``init_distributed_environment``
once: it joins the engine's process group (gloo on CPU, nccl on CUDA) and builds the TP group
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
    """A rank's view of its tensor-parallel group and the collectives the layers need."""

    rank_in_group: int = 0
    world_size: int = 1
    device_group: dist.ProcessGroup | None = None  # gloo on CPU, nccl on CUDA; None: simulated

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


_TP = GroupCoordinator()


def get_tp_group() -> GroupCoordinator:
    """The current tensor-parallel group (rank 0 of 1 unless a worker or estimate set one)."""
    return _TP


def get_tensor_model_parallel_rank() -> int:
    return _TP.rank_in_group


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
    """Join this engine's process group, build the TP group over all its ranks, make it current.

    A collective: every rank of the engine must call it (``timeout_s`` bounds the wait for the others).
    """
    global _TP
    if world_size == 1:
        _TP = GroupCoordinator()
        return _TP
    timeout = timedelta(seconds=timeout_s)
    if not dist.is_initialized():
        dist.init_process_group(backend=backend, init_method=distributed_init_method,
                                world_size=world_size, rank=rank, timeout=timeout)
    _TP = initialize_model_parallel(list(range(world_size)), backend, timeout)
    return _TP


def initialize_model_parallel(tp_ranks: list[int], backend: str, timeout: timedelta) -> GroupCoordinator:
    """The TP group over ``tp_ranks`` (a collective over the world group: every rank calls it)."""
    device_group = dist.new_group(tp_ranks, backend=backend, timeout=timeout)
    return GroupCoordinator(tp_ranks.index(dist.get_rank()), len(tp_ranks), device_group)


def destroy_distributed_environment() -> None:
    """Leave the process groups (a no-op without them) and reset the TP group."""
    global _TP
    _TP = GroupCoordinator()
    if dist.is_initialized():
        dist.destroy_process_group()
