"""Preloaded by the warm parent (see engine_ref.isolation): the heavy imports every child needs.

It imports torch and engine_ref's engine core, never a model module, and never touches CUDA. Not
torch._dynamo (~1 s): engine startup never imports it (see rotary_embedding and ActivationTracker);
the memory estimate's fake tensors do, so pytest_enginecheck preloads it for the checks that estimate.
"""

import cloudpickle  # noqa: F401 - preloaded for the children, not used here
import safetensors.torch  # noqa: F401 - preloaded for the children, not used here
import torch
import torch.distributed

import engine_ref.model_executor.layers.activation
import engine_ref.model_executor.layers.fused_moe
import engine_ref.model_executor.layers.layernorm
import engine_ref.model_executor.layers.linear
import engine_ref.model_executor.layers.rotary_embedding
import engine_ref.model_executor.layers.vocab_parallel_embedding
import engine_ref.worker.worker  # noqa: F401 - preloaded for the children, not used here

if torch.cuda.is_initialized():  # pragma: no cover - a bug in an import above
    raise RuntimeError("engine_ref.warmup initialized CUDA; the warm parent must never do that.")
