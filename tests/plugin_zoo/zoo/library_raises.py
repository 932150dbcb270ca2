"""``--enginecheck-target=zoo.library_raises:REGISTRY`` (tests/pytest_enginecheck/test_output.py): two Llamas that
print what an engine's output is full of while they load, a FutureWarning and a progress bar. One passes; the other's
own MLP calls the engine's layers wrongly: it hands down_proj the gate and up halves together, without the activation
that halves them, so the matmul below engine_ref's RowParallelLinear raises a few library frames under the author's
line."""

from __future__ import annotations

import threading
import warnings
from collections.abc import Iterable
from typing import ClassVar

import torch
from torch import nn
from tqdm import tqdm

from engine_ref.config import HFConfig
from engine_ref.model_executor.model_loader.weight_utils import CheckpointTensor
from engine_ref.model_executor.models.llama import LlamaDecoderLayer, LlamaForCausalLM, LlamaMLP
from engine_ref.model_executor.models.registry import _ModelRegistry


class NoisyLlamaForCausalLM(LlamaForCausalLM):
    example_config: ClassVar[dict] = {**LlamaForCausalLM.example_config, "architectures": ["NoisyLlamaForCausalLM"]}

    def load_weights(self, weights: Iterable[tuple[str, CheckpointTensor]]) -> set[str]:
        warnings.warn(f"{type(self).__name__}: `rope_scaling['type']` is deprecated, use `rope_type`", FutureWarning,
                      stacklevel=1)
        tqdm.set_lock(threading.RLock())  # not a multiprocessing one: this child leaves by os._exit, never unlinking it
        return super().load_weights(tqdm(list(weights), desc="Loading zoo weights"))


class NoActMLP(LlamaMLP):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        return self.down_proj(gate_up)  # the bug: act_fn(gate_up) forgotten


class NoActDecoderLayer(LlamaDecoderLayer):
    def make_mlp(self, config: HFConfig, layer_idx: int) -> nn.Module:
        return NoActMLP(config.hidden_size, config.intermediate_size, config.get("hidden_act", "silu"),
                        prefix=f"{self.prefix}.mlp")


class NoActLlamaForCausalLM(NoisyLlamaForCausalLM):
    decoder_layer_cls = NoActDecoderLayer
    example_config: ClassVar[dict] = {**LlamaForCausalLM.example_config, "architectures": ["NoActLlamaForCausalLM"]}


REGISTRY = _ModelRegistry({})
REGISTRY.register_model("NoisyLlamaForCausalLM", "zoo.library_raises:NoisyLlamaForCausalLM")
REGISTRY.register_model("NoActLlamaForCausalLM", "zoo.library_raises:NoActLlamaForCausalLM")
