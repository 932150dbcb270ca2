"""--enginecheck-strict in the engine's ranks (tests/pytest_enginecheck/test_strict_ranks.py): models whose layer 1
(not layer 0) touches or queries CUDA where only a guard in every rank process, around the build and the forwards,
sees it, and their clean twin. Each passed --enginecheck-strict while it guarded only the import and the checker's own
TP=1 rebuild: none touches CUDA at import; one asks while it is built, at TP > 1 only; the others in a forward (one of
them only in a request's decode steps, which the engine's startup never runs)."""

from __future__ import annotations

from typing import ClassVar

import torch

from engine_ref.config import HFConfig
from engine_ref.distributed.parallel_state import get_tp_group
from engine_ref.model_executor.layers.quantization.base_config import QuantizationConfig
from engine_ref.model_executor.models.llama import LlamaDecoderLayer, LlamaForCausalLM, LlamaMLP
from zoo.planted_redteam import Layer1MLPLayer


def _example(name: str) -> dict:
    return {**LlamaForCausalLM.example_config, "architectures": [name]}


# 1. load[tp=1], load[tp=2], startup: layer 1's MLP asks torch.cuda.is_available() in every forward (to pick a fused
# kernel), at every TP size. A query, so it raises nothing on a CPU machine.
class QueryForwardMLP(LlamaMLP):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.fused = torch.cuda.is_available() and x.is_cuda  # PLANTED: query in forward
        return super().forward(x)


class QueryForwardDecoderLayer(Layer1MLPLayer):
    mlp_cls = QueryForwardMLP


class QueryForwardStrictLlamaForCausalLM(LlamaForCausalLM):
    """Bug: torch.cuda.is_available() in layer 1's forward. Must be caught by: strict load and startup
    (cuda_forward)."""

    decoder_layer_cls = QueryForwardDecoderLayer
    example_config: ClassVar[dict] = _example("QueryForwardStrictLlamaForCausalLM")


# 2. load, startup: layer 1's MLP keeps a running maximum of its input on the GPU (a leftover of profiling code):
# `.cuda()` in every forward. On a GPU host it initializes CUDA in a CPU engine's worker; on a CPU-only torch it
# raises an AssertionError that names no model code.
class DotCudaForwardMLP(LlamaMLP):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.max_seen = x.detach().abs().max().cuda()  # PLANTED: touch in forward
        return super().forward(x)


class DotCudaForwardDecoderLayer(Layer1MLPLayer):
    mlp_cls = DotCudaForwardMLP


class DotCudaForwardStrictLlamaForCausalLM(LlamaForCausalLM):
    """Bug: `.cuda()` in layer 1's forward. Must be caught by: strict load and startup (cuda_forward, a touch)."""

    decoder_layer_cls = DotCudaForwardDecoderLayer
    example_config: ClassVar[dict] = _example("DotCudaForwardStrictLlamaForCausalLM")


# 3. load[tp=2], startup at TP=2: when the model is sharded, the ranks that do not lead the group ask
# torch.cuda.device_count() while layer 1 is built (to find a peer GPU for a custom all-reduce). TP=1 never asks, so
# the checker's own TP=1 rebuild never saw it.
class QueryBuildTPDecoderLayer(LlamaDecoderLayer):
    def __init__(self, config: HFConfig, layer_idx: int, quant_config: QuantizationConfig | None = None,
                 prefix: str = "") -> None:
        super().__init__(config, layer_idx, quant_config, prefix)
        group = get_tp_group()
        if layer_idx == 1 and group.world_size > 1 and group.rank_in_group > 0:
            self.peers = torch.cuda.device_count()  # PLANTED: query at build, TP > 1 only


class QueryBuildTPStrictLlamaForCausalLM(LlamaForCausalLM):
    """Bug: torch.cuda.device_count() while layer 1 is built on rank 1 of a TP > 1 engine. Must be caught by: strict
    load[tp=2] and startup (cuda_build); load[tp=1] passes."""

    decoder_layer_cls = QueryBuildTPDecoderLayer
    example_config: ClassVar[dict] = _example("QueryBuildTPStrictLlamaForCausalLM")


# 4. load (a request, not startup): layer 1 asks torch.cuda.is_available() in a decode step only (whether it may
# replay a CUDA graph), so the profile run at startup never asks; only a request's forward with the KV cache does.
class DecodeQueryDecoderLayer(LlamaDecoderLayer):
    def __init__(self, config: HFConfig, layer_idx: int, quant_config: QuantizationConfig | None = None,
                 prefix: str = "") -> None:
        super().__init__(config, layer_idx, quant_config, prefix)
        self.layer_idx = layer_idx

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor, residual: torch.Tensor | None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        if self.layer_idx == 1 and int(positions.min()) > 0:  # every sequence decodes one token
            self.graphs = torch.cuda.is_available()  # PLANTED: query in a decode step
        return super().forward(positions, hidden_states, residual)


class DecodeQueryStrictLlamaForCausalLM(LlamaForCausalLM):
    """Bug: torch.cuda.is_available() in layer 1's decode steps. Must be caught by: strict load (cuda_forward, in
    execute_model); startup runs no request."""

    decoder_layer_cls = DecodeQueryDecoderLayer
    example_config: ClassVar[dict] = _example("DecodeQueryStrictLlamaForCausalLM")


# The clean twin: layer 1 takes its device from its parameters, in its build (at TP > 1, like 3) and in its forward
# (like 1 and 2); what it would do on CUDA is behind the input's device, which is never CUDA here.
class DeviceFromParametersMLP(LlamaMLP):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        device = self.down_proj.weight.device
        if x.device.type == "cuda":  # a fused kernel's stream; never runs on a CPU engine
            torch.cuda.current_stream(x.device)
        self.max_seen = x.detach().abs().max().to(device)
        return super().forward(x)


class DeviceFromParametersDecoderLayer(Layer1MLPLayer):
    mlp_cls = DeviceFromParametersMLP

    def __init__(self, config: HFConfig, layer_idx: int, quant_config: QuantizationConfig | None = None,
                 prefix: str = "") -> None:
        super().__init__(config, layer_idx, quant_config, prefix)
        if layer_idx == 1 and get_tp_group().world_size > 1:
            self.peers = get_tp_group().world_size - 1  # from the engine's group, not from torch.cuda


class CleanStrictLlamaForCausalLM(LlamaForCausalLM):
    """Clean twin: layer 1 takes its device from its parameters. Must pass every check under --enginecheck-strict."""

    decoder_layer_cls = DeviceFromParametersDecoderLayer
    example_config: ClassVar[dict] = _example("CleanStrictLlamaForCausalLM")
