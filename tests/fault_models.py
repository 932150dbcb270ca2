"""A model that fails on purpose on one rank, for the executors' fault tests.

Workers import it by module path (``tests.fault_models:FaultyLlamaForCausalLM``), as they would an
out-of-tree model. What goes wrong is read from config.json's ``engine_ref_fault``, so one class
covers every case: ``{"rank": 1, "phase": "init" | "load_weights" | "forward",
"kind": "raise" | "hang" | "sigkill" | "sigsegv"}``. Without that field it is plain Llama.
"""

from __future__ import annotations

import ctypes
import os
import signal
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any, ClassVar

import torch

from engine_ref.config import HFConfig
from engine_ref.distributed.parallel_state import get_tensor_model_parallel_rank
from engine_ref.model_executor.model_loader.weight_utils import CheckpointTensor
from engine_ref.model_executor.models.llama import LlamaForCausalLM

FAULT_ARCH = "FaultyLlamaForCausalLM"
FAULT_KINDS = ("raise", "hang", "sigkill", "sigsegv")
FAULT_PHASES = ("init", "load_weights", "forward")


def fault_overrides(kind: str, phase: str, rank: int = 1) -> dict[str, Any]:
    """The config.json override that makes ``rank`` fail with ``kind`` in ``phase``."""
    if kind not in FAULT_KINDS or phase not in FAULT_PHASES:
        raise ValueError(f"unknown fault {kind!r} in {phase!r}")
    return {"engine_ref_fault": {"kind": kind, "phase": phase, "rank": rank}}


@contextmanager
def registered() -> Iterator[str]:
    """Register the faulty architecture (lazily, by module path) for the block; yield its name.

    It is removed afterwards, so other tests in the process (and the plugin, which checks every
    registered architecture) never see it.
    """
    from engine_ref.model_executor.models.registry import ModelRegistry

    ModelRegistry.register_model(FAULT_ARCH, f"{__name__}:FaultyLlamaForCausalLM")
    try:
        yield FAULT_ARCH
    finally:
        ModelRegistry.models.pop(FAULT_ARCH, None)


class InjectedFault(RuntimeError):
    """The exception a ``raise`` fault raises."""


class FaultyLlamaForCausalLM(LlamaForCausalLM):
    """Llama that raises, hangs or dies on the rank and in the phase config.json names."""

    example_config: ClassVar[dict] = {**LlamaForCausalLM.example_config, "architectures": [FAULT_ARCH]}

    def __init__(self, config: HFConfig) -> None:
        super().__init__(config)
        self.fault: dict[str, Any] | None = config.get("engine_ref_fault")
        self._maybe_fail("init")

    def load_weights(self, weights: Iterable[tuple[str, CheckpointTensor]]) -> set[str]:
        self._maybe_fail("load_weights")
        return super().load_weights(weights)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        self._maybe_fail("forward")
        return super().forward(input_ids, positions, inputs_embeds)

    def _maybe_fail(self, phase: str) -> None:
        fault = self.fault
        if not fault or fault["phase"] != phase or fault["rank"] != get_tensor_model_parallel_rank():
            return
        kind = fault["kind"]
        if kind == "raise":
            raise InjectedFault(f"injected fault on rank {fault['rank']} in {phase}")
        if kind == "hang":
            time.sleep(3600)
        elif kind == "sigkill":
            os.kill(os.getpid(), signal.SIGKILL)
        elif kind == "sigsegv":
            ctypes.string_at(0)  # a real segmentation fault: read address 0
