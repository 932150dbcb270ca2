"""Preloaded by the warm parent (see engine_ref.isolation): the heavy imports every child needs.

It imports torch and engine_ref's engine core, never a model module, and never touches CUDA.
"""

import cloudpickle  # noqa: F401
import safetensors.torch  # noqa: F401
import torch
import torch._dynamo  # noqa: F401 - entering a TorchDispatchMode imports it (~1 s); pay it once here
import torch.distributed  # noqa: F401

import engine_ref.model_executor.layers.activation  # noqa: F401
import engine_ref.model_executor.layers.fused_moe  # noqa: F401
import engine_ref.model_executor.layers.layernorm  # noqa: F401
import engine_ref.model_executor.layers.linear  # noqa: F401
import engine_ref.model_executor.layers.rotary_embedding  # noqa: F401
import engine_ref.model_executor.layers.vocab_parallel_embedding  # noqa: F401
import engine_ref.worker.worker  # noqa: F401

if torch.cuda.is_initialized():  # pragma: no cover - a bug in an import above
    raise RuntimeError("engine_ref.warmup initialized CUDA; the warm parent must never do that.")
