"""Reading checkpoint tensors lazily, and the parameter contract the layers implement.

The contract (vLLM's): every parameter may carry
- ``weight_loader(param, loaded_weight, shard_id=None)``: copies its shard of a checkpoint tensor;
- ``checkpoint_shapes``: ``{shard_id: full shape in the checkpoint}``, which is how a loader
  proves coverage and names what is missing, and how ``make_checkpoint`` knows what to write.

A CheckpointTensor is a handle, not data: ``narrow`` selects rows or columns and ``load`` reads
only those bytes (through ``safe_open(...).get_slice``), so a rank never reads the whole of a
tensor it only holds a shard of. ``load`` also records the tensor as consumed, which is how the
loader proves that ``load_weights`` used every tensor of the checkpoint (at least its rank's part).
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torch import nn

from engine_ref.errors import WeightLoadError

ShardId = Any  # None (whole tensor), "q"/"k"/"v", 0/1 (gate/up), (expert, "gate"|"up"|"down")


@dataclass
class LoadStats:
    """What a rank read from disk while loading."""

    bytes_read: int = 0
    tensors_read: int = 0
    # per file: [first read start, last read end] (monotonic ns), seconds spent reading, bytes read
    files: dict[str, list[int | float]] = field(default_factory=dict)

    def record(self, origin: str, start_ns: int, end_ns: int, nbytes: int) -> None:
        self.bytes_read += nbytes
        self.tensors_read += 1
        entry = self.files.setdefault(origin, [start_ns, end_ns, 0.0, 0])
        entry[1] = end_ns
        entry[2] += (end_ns - start_ns) / 1e9
        entry[3] += nbytes


class CheckpointTensor:
    """A checkpoint tensor read lazily; ``narrow`` then ``load`` reads only the selected part.

    ``consumed``, when given, is the set of checkpoint tensor names the model has consumed: ``load`` (of
    any part) and ``mark_consumed`` add this tensor's name to it.
    """

    def __init__(self, name: str, source: Any, shape: Sequence[int], origin: str,
                 stats: LoadStats | None = None, index: tuple[slice, ...] | None = None,
                 consumed: set[str] | None = None) -> None:
        self.name = name
        self.origin = origin  # the file it came from, for messages
        self._source = source  # a safetensors slice or a torch.Tensor
        self._stats = stats
        self._consumed = consumed
        self._index = index or tuple(slice(0, n) for n in shape)
        self.shape = tuple(s.stop - s.start for s in self._index)

    @classmethod
    def from_tensor(cls, name: str, tensor: torch.Tensor, origin: str, stats: LoadStats | None = None,
                    consumed: set[str] | None = None) -> CheckpointTensor:
        return cls(name, tensor, tuple(tensor.shape), origin, stats, consumed=consumed)

    def narrow(self, dim: int, start: int, length: int) -> CheckpointTensor:
        """The rows (dim 0) or columns (dim 1) ``[start, start + length)`` of this view."""
        dim = dim % len(self.shape)
        if start < 0 or start + length > self.shape[dim]:
            raise WeightLoadError(
                f"cannot take [{start}:{start + length}] of dim {dim} of {self.name!r} with shape {self.shape}"
            )
        base = self._index[dim].start
        index = list(self._index)
        index[dim] = slice(base + start, base + start + length)
        return CheckpointTensor(self.name, self._source, (), self.origin, self._stats, tuple(index), self._consumed)

    def load(self) -> torch.Tensor:
        """Read the selected part from disk."""
        index = self._index if self._index else ()
        start = time.monotonic_ns()
        try:
            tensor = self._source[index] if index else self._source[...]
        except Exception as e:  # noqa: BLE001 - a truncated or corrupt file surfaces here
            raise WeightLoadError(
                f"could not read tensor {self.name!r} from {self.origin}: {e}. The file is truncated or "
                f"corrupt; re-download or regenerate the checkpoint."
            ) from None
        if self._stats is not None:
            self._stats.record(self.origin, start, time.monotonic_ns(), tensor.numel() * tensor.element_size())
        self.mark_consumed()
        return tensor

    def mark_consumed(self) -> None:
        """Count this tensor as consumed without reading it: this rank holds none of it (a vocabulary shard
        past the end of the vocabulary), or the model's weights mapper declares it unused (``skip``)."""
        if self._consumed is not None:
            self._consumed.add(self.name)


def set_weight_attrs(param: nn.Parameter, **attrs: Any) -> None:
    """Attach loader attributes (weight_loader, checkpoint_shapes, output_dim...) to a parameter."""
    for key, value in attrs.items():
        setattr(param, key, value)


def check_shape(param_name: str, loaded: CheckpointTensor, expected: Sequence[int]) -> None:
    """Raise WeightLoadError unless the checkpoint tensor has the full shape the model expects."""
    if tuple(loaded.shape) != tuple(expected):
        raise WeightLoadError(
            f"tensor {loaded.name!r} in {loaded.origin} has shape {list(loaded.shape)}, but the model's "
            f"{param_name} expects {list(expected)}; the checkpoint does not match config.json."
        )


def copy_into(param: torch.Tensor, loaded: torch.Tensor, name: str) -> None:
    """``param.copy_(loaded)`` after checking shapes (a shard-shape mismatch is a loader bug)."""
    if param.shape != loaded.shape:
        raise WeightLoadError(f"shard of {name!r} has shape {list(loaded.shape)}, expected {list(param.shape)}")
    param.data.copy_(loaded)


def default_weight_loader(param: nn.Parameter, loaded_weight: CheckpointTensor) -> None:
    """Load a replicated (unsharded) parameter: the whole tensor, shape-checked."""
    check_shape(loaded_weight.name, loaded_weight, param.shape)
    copy_into(param, loaded_weight.load(), loaded_weight.name)


def checkpoint_shapes(param: nn.Parameter) -> dict[ShardId, tuple[int, ...]]:
    """``param``'s ``checkpoint_shapes``; an unsharded parameter without one is its own shape."""
    return getattr(param, "checkpoint_shapes", None) or {None: tuple(param.shape)}


def param_dim(param: nn.Parameter, name: Literal["output_dim", "input_dim"]) -> int | None:
    """The dim of ``param`` that ``set_weight_attrs`` marked as split over ranks along the layer's output
    (``output_dim``) or input (``input_dim``); None where it marked none."""
    return getattr(param, name, None)


@dataclass(frozen=True)
class WeightsMapper:
    """Checkpoint names <-> (parameter name, shard id), by substring, like vLLM's stacked mapping.

    ``renames`` entries ``(param_part, weight_part)`` rename modules (Mixtral's
    ``block_sparse_moe`` is the model's ``mlp``). ``mapping`` entries ``(param_part, weight_part,
    shard_id)`` stack tensors: ``...q_proj.weight`` loads shard "q" of ``...qkv_proj.weight``; the
    first match wins. Names containing any of ``skip`` are checkpoint tensors the model does not use.
    """

    mapping: tuple[tuple[str, str, ShardId], ...] = ()
    renames: tuple[tuple[str, str], ...] = ()
    skip: tuple[str, ...] = ()

    def to_param(self, name: str) -> tuple[str, ShardId] | None:
        if any(part in name for part in self.skip):
            return None
        for param_part, weight_part in self.renames:
            name = name.replace(weight_part, param_part)
        for param_part, weight_part, shard_id in self.mapping:
            if weight_part in name:
                return name.replace(weight_part, param_part), shard_id
        return name, None

    def to_checkpoint(self, param_name: str, shard_id: ShardId) -> str:
        name = param_name
        if shard_id is not None:
            for param_part, weight_part, sid in self.mapping:
                if sid == shard_id and param_part in param_name:
                    name = param_name.replace(param_part, weight_part)
                    break
            else:
                raise KeyError(f"no checkpoint name for shard {shard_id!r} of {param_name}")
        for param_part, weight_part in self.renames:
            name = name.replace(param_part, weight_part)
        return name


def expected_checkpoint_tensors(model: nn.Module, mapper: WeightsMapper) -> dict[str, tuple[int, ...]]:
    """Every checkpoint tensor name the model loads, with its full (unsharded) shape."""
    return {
        mapper.to_checkpoint(param_name, shard_id): shape
        for param_name, param in model.named_parameters()
        for shard_id, shape in checkpoint_shapes(param).items()
    }


def load_mapped_weights(model: nn.Module, weights: Iterable[tuple[str, CheckpointTensor]],
                        mapper: WeightsMapper) -> set[str]:
    """Feed checkpoint tensors to the parameters' weight loaders; return the loaded parameter names.

    Raises WeightLoadError naming any checkpoint tensor the model has no parameter for, and any
    parameter shard the checkpoint did not provide, except one whose tensor ``mapper.skip`` declares
    unused: that parameter is derived by the model, whose load_weights returns its name itself.
    """
    params = dict(model.named_parameters())
    loaded: dict[str, set[ShardId]] = defaultdict(set)
    for name, tensor in weights:
        target = mapper.to_param(name)
        if target is None:  # declared unused (skip), after the renames the model's load_weights made
            tensor.mark_consumed()
            continue
        param_name, shard_id = target
        param = params.get(param_name)
        if param is None:
            raise WeightLoadError(
                f"unexpected tensor {name!r} in {tensor.origin}: {type(model).__name__} has no parameter "
                f"for it. The checkpoint belongs to another architecture or config; check config.json."
            )
        loader: Callable[..., None] = getattr(param, "weight_loader", default_weight_loader)
        if shard_id is None:
            loader(param, tensor)
        else:
            loader(param, tensor, shard_id)
        loaded[param_name].add(shard_id)
    missing = [
        name
        for param_name, param in params.items()
        for shard_id in checkpoint_shapes(param)
        if shard_id not in loaded[param_name]
        and mapper.to_param(name := mapper.to_checkpoint(param_name, shard_id)) is not None
    ]
    if missing:
        raise missing_tensors_error(missing)
    return set(loaded)


def unconsumed_tensors_error(model_name: str, unconsumed: dict[str, str]) -> WeightLoadError:
    """The error for checkpoint tensors (name -> file) that ``model_name.load_weights`` never consumed."""
    shown = ", ".join(f"{n!r} ({unconsumed[n]})" for n in sorted(unconsumed)[:8])
    more = f" and {len(unconsumed) - 8} more" if len(unconsumed) > 8 else ""
    return WeightLoadError(
        f"{model_name}.load_weights did not consume {len(unconsumed)} checkpoint tensor(s): {shown}{more}. It "
        f"dropped them silently, so what they hold is not in the model. Consume each in load_weights (hand it to "
        f"its parameter's weight_loader, which reads it with CheckpointTensor.load), or, if the model does not use "
        f"it, declare it unused in the model's weights_mapper (WeightsMapper(skip=(...)))."
    )


def missing_tensors_error(names: list[str]) -> WeightLoadError:
    shown = ", ".join(repr(n) for n in sorted(names)[:8])
    more = f" and {len(names) - 8} more" if len(names) > 8 else ""
    return WeightLoadError(
        f"the checkpoint is missing {len(names)} tensor(s) the model needs: {shown}{more}. "
        f"It is incomplete or was written for another config."
    )
