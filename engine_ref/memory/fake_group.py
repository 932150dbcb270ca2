"""A fake default process group for one simulated rank: what ``torch.distributed`` answers a model the estimate
builds.

An engine worker at TP>1 joins a real process group (gloo, nccl) before it builds the model, so a model may ask
``torch.distributed.get_rank()`` or ``get_world_size()`` while it is built or run. The estimate builds every rank
in one process without one (``tensor_parallel_state`` simulates only the engine's own TP group), so without this
such a model fails there ("Default process group has not been initialized") while it starts fine in the engine.
``fake_process_group`` initialises torch's own ``"fake"`` backend (no store, no peers, collectives that only keep
their shapes) for that rank and world size, and destroys it on the way out. At TP=1 a worker joins no process
group, and neither does the estimate: a model that asks for its rank unguarded there fails alike in both.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch.distributed as dist


@contextmanager
def fake_process_group(rank: int, world_size: int) -> Iterator[None]:
    """Make ``torch.distributed``'s default process group rank ``rank`` of ``world_size`` (fake backend) inside.

    Nothing is done at ``world_size`` 1 (the engine joins no group then), where torch.distributed is not built in,
    or where the process already has a default group (a distributed job calling the estimate keeps its own)."""
    if world_size == 1 or not dist.is_available() or dist.is_initialized():
        yield
        return
    dist.init_process_group("fake", rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()
