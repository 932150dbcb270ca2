"""ParallelConfig: the tensor parallel size, the executor that runs the ranks and their timeouts; and which
tensor parallel sizes split a model evenly."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from engine_ref import envs
from engine_ref.config.hf_config import get_text_config
from engine_ref.config.utils import positive_int
from engine_ref.errors import ConfigError

if TYPE_CHECKING:
    from engine_ref.config.model import ModelConfig

EXECUTOR_BACKENDS = ("uni", "mp", "ray")
DEFAULT_READY_TIMEOUT_S = 300.0
DEFAULT_RPC_TIMEOUT_S = 300.0
DEFAULT_COLLECTIVE_TIMEOUT_S = 300.0


def _seconds(name: str, value: Any, from_env: Callable[[], float | None], default: float) -> float:
    """``value``, else its environment variable, else ``default``: a finite positive number of seconds."""
    if value is None:
        value = from_env() or default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
        raise ConfigError(f"{name}={value!r} must be a finite positive number of seconds.")
    return float(value)


@dataclass(init=False)
class ParallelConfig:
    """How the model is split: tensor parallel size and the executor that runs the ranks.

    Left as None, the backend becomes 'uni' for one rank and 'mp' for more, and each timeout its
    ENGINE_REF_* environment variable, else 300 s; once built, all are set.
    """

    tensor_parallel_size: int
    distributed_executor_backend: str
    ready_timeout_s: float  # workers' startup, and the rendezvous of the process group
    rpc_timeout_s: float  # each call to the workers after startup (a generate step)
    collective_timeout_s: float  # each collective of the TP group (gloo/nccl)

    def __init__(self, tensor_parallel_size: int = 1, distributed_executor_backend: str | None = None,
                 ready_timeout_s: float | None = None, rpc_timeout_s: float | None = None,
                 collective_timeout_s: float | None = None) -> None:
        positive_int("tensor_parallel_size", tensor_parallel_size)
        self.tensor_parallel_size = tensor_parallel_size
        if distributed_executor_backend is None:
            distributed_executor_backend = "uni" if tensor_parallel_size == 1 else "mp"
        if distributed_executor_backend not in EXECUTOR_BACKENDS:
            raise ConfigError(
                f"distributed_executor_backend={distributed_executor_backend!r} is unknown; "
                f"use one of {', '.join(EXECUTOR_BACKENDS)}."
            )
        if distributed_executor_backend == "uni" and tensor_parallel_size > 1:
            raise ConfigError(
                f"distributed_executor_backend='uni' runs one rank, but tensor_parallel_size="
                f"{tensor_parallel_size}; use 'mp' or 'ray', or tensor_parallel_size=1."
            )
        self.distributed_executor_backend = distributed_executor_backend
        self.ready_timeout_s = _seconds("ready_timeout_s", ready_timeout_s, envs.ready_timeout_s,
                                        DEFAULT_READY_TIMEOUT_S)
        self.rpc_timeout_s = _seconds("rpc_timeout_s", rpc_timeout_s, envs.rpc_timeout_s, DEFAULT_RPC_TIMEOUT_S)
        self.collective_timeout_s = _seconds("collective_timeout_s", collective_timeout_s,
                                             envs.collective_timeout_s, DEFAULT_COLLECTIVE_TIMEOUT_S)

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size


def tensor_parallel_dims(hf_config: Mapping[str, Any]) -> dict[str, int]:
    """The sizes tensor parallelism splits evenly: attention heads and MLP widths, text and vision."""
    text = get_text_config(hf_config)
    dims = {"num_attention_heads": text["num_attention_heads"]}
    for key in ("intermediate_size", "moe_intermediate_size"):
        if isinstance(text.get(key), int):
            dims[key] = text[key]
    vision = hf_config.get("vision_config") or {}
    for key in ("num_attention_heads", "intermediate_size"):
        if isinstance(vision.get(key), int):
            dims[f"vision_config.{key}"] = vision[key]
    return dims


def _kv_heads_split(num_kv_heads: int, tp: int) -> bool:
    """KV heads are split over ranks, or each replicated on tp / num_kv_heads ranks."""
    return num_kv_heads % tp == 0 or tp % num_kv_heads == 0


def valid_tensor_parallel_sizes(hf_config: Mapping[str, Any], limit: int = 64) -> list[int]:
    """Every tensor_parallel_size up to ``limit`` that splits the model evenly."""
    dims = tensor_parallel_dims(hf_config)
    text = get_text_config(hf_config)
    kv_heads = text.get("num_key_value_heads") or text["num_attention_heads"]
    return [tp for tp in range(1, limit + 1)
            if all(size % tp == 0 for size in dims.values()) and _kv_heads_split(kv_heads, tp)]


def verify_tensor_parallel_size(model: ModelConfig, tp: int) -> None:
    """Raise ConfigError when tp does not split the heads (text and vision) and MLP widths evenly."""
    uneven = [f"{name}={size}" for name, size in tensor_parallel_dims(model.hf_config).items() if size % tp]
    if not _kv_heads_split(model.num_key_value_heads, tp):
        uneven.append(f"num_key_value_heads={model.num_key_value_heads} (and is not a multiple of it)")
    if uneven:
        raise ConfigError(
            f"tensor_parallel_size={tp} does not divide {' or '.join(uneven)} of {model.architecture}; "
            f"use one of {valid_tensor_parallel_sizes(model.hf_config)}."
        )
