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

from engine_ref.errors import EngineRefError


class CollectiveTimeoutError(EngineRefError):
    """A collective of the TP group outlived ``collective_timeout_s``: a peer rank did not take part in it."""


@dataclass
class GroupCoordinator:
    """A rank's view of its tensor-parallel group and the collectives the layers need."""

    rank_in_group: int = 0
    world_size: int = 1
    device_group: dist.ProcessGroup | None = None  # gloo on CPU, nccl on CUDA; None: simulated
    timeout_s: float = 0.0  # of each collective, for messages

    def _timed_out(self, op: str, error: RuntimeError) -> CollectiveTimeoutError:
        """The backend's timeout (gloo: 'Timed out waiting ...') as ours, naming the setting."""
        return CollectiveTimeoutError(
            f"{op} over the TP group timed out on rank {self.rank_in_group} after {self.timeout_s:g} s "
            f"(collective_timeout_s / ENGINE_REF_COLLECTIVE_TIMEOUT_S): a peer rank did not take part "
            f"(stopped, hung, or far slower than this one). {error}")

    def all_reduce(self, input_: torch.Tensor) -> torch.Tensor:
        """Sum over ranks, in place. Row-parallel layers call this on their partial outputs."""
        if self.world_size > 1 and self.device_group is not None:
            try:
                dist.all_reduce(input_, group=self.device_group)
            except RuntimeError as e:
                if "timed out" not in str(e).lower():
                    raise
                raise self._timed_out("all_reduce", e) from e
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
            try:
                dist.all_gather(gathered, local, group=self.device_group)
            except RuntimeError as e:
                if "timed out" not in str(e).lower():
                    raise
                raise self._timed_out("all_gather", e) from e
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


def init_distributed_environment(world_size: int, rank: int, distributed_init_method: str, backend: str,
                                 timeout_s: float = 300.0, collective_timeout_s: float = 300.0) -> GroupCoordinator:
    """Join this engine's process group, build the TP group over all its ranks, make it current.

    A collective: every rank of the engine must call it. ``timeout_s`` bounds the rendezvous (the
    wait for the other ranks to arrive); ``collective_timeout_s`` bounds each collective of the TP
    group afterwards, so that a rank whose peer hangs raises instead of waiting for ever.
    """
    global _TP
    if world_size == 1:
        _TP = GroupCoordinator()
        return _TP
    if not dist.is_initialized():
        dist.init_process_group(backend=backend, init_method=distributed_init_method,
                                world_size=world_size, rank=rank, timeout=timedelta(seconds=timeout_s))
    dist.barrier()  # every rank is here: forming the TP group waits for no one, under its shorter timeout
    _TP = initialize_model_parallel(list(range(world_size)), backend, timedelta(seconds=collective_timeout_s))
    return _TP


def initialize_model_parallel(tp_ranks: list[int], backend: str, timeout: timedelta) -> GroupCoordinator:
    """The TP group over ``tp_ranks`` (a collective over the world group: every rank calls it)."""
    device_group = dist.new_group(tp_ranks, backend=backend, timeout=timeout)
    return GroupCoordinator(tp_ranks.index(dist.get_rank()), len(tp_ranks), device_group, timeout.total_seconds())


def destroy_distributed_environment() -> None:
    """Leave the process groups (a no-op without them) and reset the TP group."""
    global _TP
    _TP = GroupCoordinator()
    if dist.is_initialized():
        dist.destroy_process_group()
