"""Planted memory bugs that startup never sees (its profile run is one prefill), each in layer 1's MLP of a tiny
Llama and the same at every TP size: budget[tp=N]'s workload (prefill, decode steps, a second round) must catch
each, naming the phase or the size and the rank. Beside them, clean twins that allocate in the same places and
must pass.

``zoo.budget_registry:REGISTRY`` registers them (tests/pytest_enginecheck/test_budget_workload.py).
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from engine_ref.model_executor.forward_context import get_attn_metadata
from engine_ref.model_executor.models.llama import LlamaDecoderLayer, LlamaForCausalLM, LlamaMLP
from zoo.planted_redteam import Layer1MLPLayer

MiB = 1 << 20
DECODE_SCRATCH = 768 * MiB  # more than the budget check's default device (--enginecheck-budget-memory=512MiB)
FITTING_SCRATCH = 64 * MiB
STEP_TENSOR = 4 * MiB


def in_decode_step() -> bool:
    """Whether this forward pass is a decode step: every sequence adds one token to the KV cache it filled before."""
    md = get_attn_metadata()
    return md.slot_mapping is not None and md.query_start_loc[-1] == len(md.seq_lens) and min(md.seq_lens) > 1


def staged(x: torch.Tensor, scratch: torch.Tensor) -> torch.Tensor:
    """``x`` copied into the front of a byte buffer (a workspace's use): a view of ``scratch``."""
    return scratch[:x.numel() * x.element_size()].view(x.dtype).view(x.shape).copy_(x)


class _Layer1MLP(LlamaMLP):
    """An MLP whose ``forward`` the planted classes change; layer 1 gets it."""


def _example(name: str) -> dict[str, Any]:
    return {**LlamaForCausalLM.example_config, "architectures": [name]}


# 1. A decode-only workspace larger than the budget: the profile run (a prefill) never allocates it.
class DecodeScratchMLP(_Layer1MLP):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if in_decode_step():
            x = staged(x, torch.empty(DECODE_SCRATCH, dtype=torch.uint8, device=x.device)).clone()
        return super().forward(x)


# 2. A per-request leak: every forward call keeps 4 MiB alive (appended to a list on the module).
class LeakyMLP(_Layer1MLP):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.seen: list[torch.Tensor] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen.append(torch.empty(STEP_TENSOR, dtype=torch.uint8, device=x.device))
        return super().forward(x)


# Clean twin of 1 and 2: a decode-only scratch that fits, held on the module during the step and freed after use.
class FreedScratchMLP(_Layer1MLP):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.scratch: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not in_decode_step():
            return super().forward(x)
        self.scratch = torch.empty(FITTING_SCRATCH, dtype=torch.uint8, device=x.device)
        out = super().forward(staged(x, self.scratch).clone())
        self.scratch = None
        return out


# Clean twin of 2: the same 4 MiB scratch allocated in every step, none of it kept.
class StepScratchMLP(_Layer1MLP):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(staged(x, torch.empty(STEP_TENSOR, dtype=torch.uint8, device=x.device)).clone())


# Clean twin of 2: a 4 MiB workspace made at the first decode step and reused by every later one (held, not grown).
class CachedWorkspaceMLP(_Layer1MLP):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.workspace: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not in_decode_step():
            return super().forward(x)
        if self.workspace is None:
            self.workspace = torch.empty(STEP_TENSOR, dtype=torch.uint8, device=x.device)
        return super().forward(staged(x, self.workspace).clone())


class DecodeScratchDecoderLayer(Layer1MLPLayer):
    mlp_cls: ClassVar[type[_Layer1MLP]] = DecodeScratchMLP


class DecodeScratchLlamaForCausalLM(LlamaForCausalLM):
    decoder_layer_cls: ClassVar[type[LlamaDecoderLayer]] = DecodeScratchDecoderLayer
    example_config: ClassVar[dict] = _example("DecodeScratchLlamaForCausalLM")


class LeakyForwardDecoderLayer(Layer1MLPLayer):
    mlp_cls: ClassVar[type[_Layer1MLP]] = LeakyMLP


class LeakyForwardLlamaForCausalLM(LlamaForCausalLM):
    decoder_layer_cls: ClassVar[type[LlamaDecoderLayer]] = LeakyForwardDecoderLayer
    example_config: ClassVar[dict] = _example("LeakyForwardLlamaForCausalLM")


class FreedScratchDecoderLayer(Layer1MLPLayer):
    mlp_cls: ClassVar[type[_Layer1MLP]] = FreedScratchMLP


class FreedScratchLlamaForCausalLM(LlamaForCausalLM):
    decoder_layer_cls: ClassVar[type[LlamaDecoderLayer]] = FreedScratchDecoderLayer
    example_config: ClassVar[dict] = _example("FreedScratchLlamaForCausalLM")


class StepScratchDecoderLayer(Layer1MLPLayer):
    mlp_cls: ClassVar[type[_Layer1MLP]] = StepScratchMLP


class StepScratchLlamaForCausalLM(LlamaForCausalLM):
    decoder_layer_cls: ClassVar[type[LlamaDecoderLayer]] = StepScratchDecoderLayer
    example_config: ClassVar[dict] = _example("StepScratchLlamaForCausalLM")


class CachedWorkspaceDecoderLayer(Layer1MLPLayer):
    mlp_cls: ClassVar[type[_Layer1MLP]] = CachedWorkspaceMLP


class CachedWorkspaceLlamaForCausalLM(LlamaForCausalLM):
    decoder_layer_cls: ClassVar[type[LlamaDecoderLayer]] = CachedWorkspaceDecoderLayer
    example_config: ClassVar[dict] = _example("CachedWorkspaceLlamaForCausalLM")
