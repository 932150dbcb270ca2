"""8-bit weights with float32 scales: what fp8 and int8 share (parameters, loaders, conversion, apply).

A weight ``W`` (``[..., rows, cols]``; MoE weights have a leading expert dim) is stored as
``q = cast(W / s)`` and used as ``q * s`` in the activation dtype (weight-only: the matmul runs in
the activation dtype, as a CPU does). ``s`` is symmetric, ``amax / qmax``:
- per output channel: one scale per row, ``[..., rows, 1]`` (checkpoint ``weight_scale`` ``[rows, 1]``);
- per tensor: one scale per checkpoint tensor, ``[..., n]`` for a weight stacking n of them
  (checkpoint ``weight_scale`` ``[]``). A packed ``qkv_proj`` / ``gate_up_proj`` keeps one scale
  per sub-projection (q, k, v / gate, up) instead of requantizing them to one shared scale: the
  loaded bytes are the checkpoint's, and on-the-fly equals a pre-quantized checkpoint exactly.

Scales shard with their weights: a per-channel scale follows the rows of a column-parallel weight
and is replicated on row-parallel ones; a per-tensor scale is replicated. Converting on the fly,
a rank's amax covers only its shard, so it is maxed over the TP group wherever the quantization
group spans ranks (per-tensor scales, per-channel scales of row-parallel layers): every TP size
gets the scales TP=1 gets, from the whole checkpoint tensor.
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from engine_ref.distributed.parallel_state import get_tp_group
from engine_ref.errors import QuantizationError, WeightLoadError
from engine_ref.model_executor.layers.fused_moe import FusedMoE, UnquantizedFusedMoEMethod, fused_experts
from engine_ref.model_executor.layers.linear import LinearBase, UnquantizedLinearMethod
from engine_ref.model_executor.layers.quantization.base_config import (
    FusedMoEMethodBase,
    LinearMethodBase,
    QuantizationConfig,
    QuantizeMethodBase,
    is_layer_skipped,
)
from engine_ref.model_executor.model_loader.weight_utils import CheckpointTensor, ShardId, set_weight_attrs

SCALE_DTYPE = torch.float32


class ScaledQuantizationConfig(QuantizationConfig):
    """A weight-only 8-bit method: its dtype, ``qmax``, ``cast`` and scale granularity.

    ``is_checkpoint_serialized``: the checkpoint holds 8-bit weights and scales (``from_config``);
    otherwise the model-dtype weights are loaded and converted after loading.
    """

    per_channel: bool

    def __init__(self, is_checkpoint_serialized: bool = False, ignored_layers: Sequence[str] = ()) -> None:
        self.is_checkpoint_serialized = is_checkpoint_serialized
        self.ignored_layers = list(ignored_layers)

    def on_the_fly(self) -> ScaledQuantizationConfig:
        return type(self)(False, self.ignored_layers)

    @abstractmethod
    def to_hf_config(self) -> dict[str, Any]:
        """The ``quantization_config`` a checkpoint quantized this way carries (``from_config`` reads it)."""

    @property
    @abstractmethod
    def weight_dtype(self) -> torch.dtype: ...

    @property
    @abstractmethod
    def qmax(self) -> float:
        """The largest magnitude the dtype holds (448 for float8_e4m3fn, 127 for int8)."""

    @abstractmethod
    def cast(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` (already divided by its scale, so within ``[-qmax, qmax]``) in ``weight_dtype``."""

    @classmethod
    def check_config(cls, config: dict[str, Any], supported: dict[str, tuple[Any, ...]]) -> None:
        """QuantizationError unless quant_method is this method's and every key in ``supported`` has a
        supported value (``None`` in a tuple: the key may be absent)."""
        if config.get("quant_method") != cls.get_name():
            raise QuantizationError(
                f"quantization_config has quant_method={config.get('quant_method')!r}, not {cls.get_name()!r}; "
                f"use quantization={config.get('quant_method')!r} or a checkpoint quantized with {cls.get_name()}.")
        for key, values in supported.items():
            if config.get(key) not in values:
                raise QuantizationError(
                    f"{cls.get_name()} checkpoints with {key}={config.get(key)!r} are not supported; engine_ref "
                    f"reads {key} in {[v for v in values if v is not None]}. Quantize the unquantized model at "
                    f"startup with quantization={cls.get_name()!r} instead.")

    def get_quant_method(self, layer: nn.Module, prefix: str) -> QuantizeMethodBase[Any]:
        skipped = is_layer_skipped(prefix, self.ignored_layers)
        if isinstance(layer, LinearBase):
            return UnquantizedLinearMethod() if skipped else ScaledLinearMethod(self)
        if isinstance(layer, FusedMoE):
            return UnquantizedFusedMoEMethod() if skipped else ScaledMoEMethod(self)
        raise QuantizationError(
            f"{self.get_name()} cannot quantize {prefix or 'a layer'} ({type(layer).__name__}): it quantizes "
            f"linear layers and MoE experts. Build that layer without quant_config, or list it in ignored_layers.")

    # -- the arithmetic, on [..., rows, cols] weights ---------------------------------------------

    def compute_scale(self, weight: torch.Tensor, row_groups: Sequence[int], input_sharded: bool) -> torch.Tensor:
        """Symmetric scales of ``weight``; ``row_groups``: rows of each stacked checkpoint tensor."""
        amax = weight.float().abs().amax(dim=-1, keepdim=True)
        if not self.per_channel:
            amax = torch.stack([group.amax(dim=(-2, -1)) for group in amax.split(list(row_groups), dim=-2)], dim=-1)
        if not self.per_channel or input_sharded:
            amax = _tp_max(amax)
        return amax.clamp(min=torch.finfo(SCALE_DTYPE).tiny) / self.qmax

    def quantize(self, weight: torch.Tensor, scale: torch.Tensor, row_groups: Sequence[int]) -> torch.Tensor:
        return self.cast(weight.float() / self.scale_rows(scale, row_groups))

    def dequantize(self, qweight: torch.Tensor, scale: torch.Tensor, row_groups: Sequence[int],
                   dtype: torch.dtype) -> torch.Tensor:
        return (qweight.float() * self.scale_rows(scale, row_groups)).to(dtype)

    def scale_rows(self, scale: torch.Tensor, row_groups: Sequence[int]) -> torch.Tensor:
        """The scale of every row, ``[..., rows, 1]``."""
        if self.per_channel:
            return scale
        rows = [s.unsqueeze(-1).expand(*s.shape, n) for s, n in zip(scale.unbind(-1), row_groups, strict=True)]
        return torch.cat(rows, dim=-1).unsqueeze(-1)

    def scale_shape(self, leading: tuple[int, ...], rows: int, num_groups: int) -> tuple[int, ...]:
        return (*leading, rows, 1) if self.per_channel else (*leading, num_groups)

    def checkpoint_scale_shape(self, rows: int) -> tuple[int, ...]:
        return (rows, 1) if self.per_channel else ()


def _tp_max(x: torch.Tensor) -> torch.Tensor:
    """Elementwise max of ``x`` over the TP group (through its all_gather)."""
    tp = get_tp_group()
    return x if tp.world_size == 1 else tp.all_gather(x.unsqueeze(0), dim=0).amax(dim=0)


def _load_tensor_scale(param: nn.Parameter, loaded: CheckpointTensor, slot: tuple[int, ...]) -> None:
    """A per-tensor scale (``[]``, or ``[1]`` as some writers store it) into its slot of ``param``."""
    if tuple(loaded.shape) not in ((), (1,)):
        raise WeightLoadError(
            f"tensor {loaded.name!r} in {loaded.origin} has shape {list(loaded.shape)}, but a per-tensor "
            f"weight_scale is a scalar ([] or [1]); the checkpoint's scales do not match its quantization_config.")
    param.data[slot] = loaded.load().reshape(())


def _scale_param(shape: tuple[int, ...], **attrs: Any) -> nn.Parameter:
    param = nn.Parameter(torch.empty(shape, dtype=SCALE_DTYPE), requires_grad=False)
    set_weight_attrs(param, **attrs)
    return param


class ScaledLinearMethod(LinearMethodBase):
    """A linear layer's weight in 8 bits with ``weight_scale``; ``apply`` dequantizes to x's dtype."""

    def __init__(self, config: ScaledQuantizationConfig) -> None:
        self.config = config

    def row_groups(self, layer: LinearBase) -> list[int]:
        return [layer.output_shard(shard_id)[1] for shard_id in layer.output_shards]

    def create_weights(self, layer: LinearBase) -> None:
        serialized = self.config.is_checkpoint_serialized
        dtype = self.config.weight_dtype if serialized else torch.get_default_dtype()
        weight = nn.Parameter(torch.empty(layer.output_size_per_partition, layer.input_size_per_partition,
                                          dtype=dtype), requires_grad=False)
        set_weight_attrs(weight, output_dim=0, input_dim=1, weight_loader=layer.weight_loader,
                         checkpoint_shapes=layer.shard_shapes(layer.input_size))
        layer.register_parameter("weight", weight)
        if not serialized:
            return
        set_weight_attrs(weight, checkpoint_dtype=dtype)
        shape = self.config.scale_shape((), layer.output_size_per_partition, len(layer.output_shards))
        if self.config.per_channel:
            scale = _scale_param(shape, output_dim=0, weight_loader=layer.weight_loader,
                                 checkpoint_shapes=layer.shard_shapes(1))
        else:
            slots = {shard_id: (i,) for i, shard_id in enumerate(layer.output_shards)}
            scale = _scale_param(shape, checkpoint_shapes=dict.fromkeys(layer.output_shards, ()),
                                 weight_loader=lambda p, t, shard_id=None: _load_tensor_scale(p, t, slots[shard_id]))
        layer.register_parameter("weight_scale", scale)

    def process_weights_after_loading(self, layer: LinearBase) -> None:
        if self.config.is_checkpoint_serialized:
            return
        groups = self.row_groups(layer)
        scale = self.config.compute_scale(layer.weight, groups, input_sharded=layer.input_size_per_partition
                                          < layer.input_size)
        layer.weight = nn.Parameter(self.config.quantize(layer.weight, scale, groups), requires_grad=False)
        layer.weight_scale = nn.Parameter(scale, requires_grad=False)

    def dequantized_weights(self, layer: LinearBase, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
        """The weight ``apply`` multiplies by, by parameter name."""
        return {"weight": self.config.dequantize(layer.weight, layer.get_parameter("weight_scale"),
                                                 self.row_groups(layer), dtype)}

    def apply(self, layer: LinearBase, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return F.linear(x, self.dequantized_weights(layer, x.dtype)["weight"], bias)


class ScaledMoEMethod(FusedMoEMethodBase):
    """The experts' w13 and w2 in 8 bits with ``w13_weight_scale`` / ``w2_weight_scale``."""

    def __init__(self, config: ScaledQuantizationConfig) -> None:
        self.config = config

    def create_weights(self, layer: FusedMoE) -> None:
        serialized = self.config.is_checkpoint_serialized
        dtype = self.config.weight_dtype if serialized else torch.get_default_dtype()
        shard, hidden, experts = layer.intermediate_size_per_partition, layer.hidden_size, layer.num_experts
        w13 = nn.Parameter(torch.empty(experts, 2 * shard, hidden, dtype=dtype), requires_grad=False)
        w2 = nn.Parameter(torch.empty(experts, hidden, shard, dtype=dtype), requires_grad=False)
        set_weight_attrs(w13, weight_loader=layer.weight_loader, checkpoint_shapes=layer.shard_shapes("w13", hidden))
        set_weight_attrs(w2, input_dim=1, weight_loader=layer.weight_loader,
                         checkpoint_shapes=layer.shard_shapes("w2", layer.intermediate_size))
        layer.register_parameter("w13_weight", w13)
        layer.register_parameter("w2_weight", w2)
        if not serialized:
            return
        set_weight_attrs(w13, checkpoint_dtype=dtype)
        set_weight_attrs(w2, checkpoint_dtype=dtype)
        for name, rows, groups in (("w13", 2 * shard, 2), ("w2", hidden, 1)):
            shape = self.config.scale_shape((experts,), rows, groups)
            if self.config.per_channel:
                scale = _scale_param(shape, weight_loader=layer.weight_loader,
                                     checkpoint_shapes=layer.shard_shapes(name, 1))
            else:
                scale = _scale_param(shape, checkpoint_shapes={k: () for k in layer.shard_shapes(name)},
                                     weight_loader=_load_expert_tensor_scale)
            layer.register_parameter(f"{name}_weight_scale", scale)

    def row_groups(self, layer: FusedMoE) -> dict[str, list[int]]:
        shard = layer.intermediate_size_per_partition
        return {"w13": [shard, shard], "w2": [layer.hidden_size]}

    def process_weights_after_loading(self, layer: FusedMoE) -> None:
        if self.config.is_checkpoint_serialized:
            return
        for name, groups in self.row_groups(layer).items():
            weight = layer.get_parameter(f"{name}_weight")
            scale = self.config.compute_scale(weight, groups, input_sharded=name == "w2" and layer.tp_size > 1)
            setattr(layer, f"{name}_weight", nn.Parameter(self.config.quantize(weight, scale, groups),
                                                          requires_grad=False))
            setattr(layer, f"{name}_weight_scale", nn.Parameter(scale, requires_grad=False))

    def dequantized_weights(self, layer: FusedMoE, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
        """Every expert's w13 and w2 as ``apply`` multiplies by them, by parameter name."""
        return {f"{name}_weight": self.config.dequantize(layer.get_parameter(f"{name}_weight"),
                                                         layer.get_parameter(f"{name}_weight_scale"), groups, dtype)
                for name, groups in self.row_groups(layer).items()}

    def apply(self, layer: FusedMoE, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
              ) -> torch.Tensor:
        groups = self.row_groups(layer)

        def dequantize(name: str, e: int, dtype: torch.dtype) -> torch.Tensor:
            return self.config.dequantize(layer.get_parameter(f"{name}_weight")[e],
                                          layer.get_parameter(f"{name}_weight_scale")[e], groups[name], dtype)

        def expert_weights(e: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
            return dequantize("w13", e, dtype), dequantize("w2", e, dtype)

        return fused_experts(x, topk_weights, topk_ids, expert_weights)


def _load_expert_tensor_scale(param: nn.Parameter, loaded: CheckpointTensor, shard_id: tuple[int, ShardId]) -> None:
    expert, which = shard_id
    _load_tensor_scale(param, loaded, (expert, 1 if which == "up" else 0))
