"""StepMemoryTracker: one rank's memory while it serves requests, which startup's profile run does not see.

The profile run is one prefill of max_num_batched_tokens tokens without a KV cache. Requests run more: prefills
into the KV cache, then decode steps of one token per sequence. A model can allocate in those steps what the
profile never allocated (a decode-only workspace), or keep tensors alive from one step to the next (a per-request
leak). Once a caller turns it on (``Worker.track_step_memory``), the tracker wraps every step and records, per
phase ("prefill" or "decode"), the most bytes the steps had allocated at once, and the bytes the steps still hold
between steps: the same requests run twice should leave the same bytes held after each round.

Only tensors created inside the steps count: the weights, buffers, LoRA slots and KV cache existed before (the
KV cache is written in place). On CPU ActivationTracker counts storages exactly, as the profile run does; on CUDA
torch.cuda's allocator statistics give the same figures, above what was allocated when tracking began.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any, TypeVar

import torch

from engine_ref.memory.tracker import ActivationTracker

T = TypeVar("T")

#: The phases of a step: a batch of prompts (``prefill``) or one new token of every running request (``decode``).
PHASES = ("prefill", "decode")


@dataclass
class PhasePeak:
    """The highest moment of one phase's steps: what that step itself had allocated (``activations``) and what
    earlier steps still held when it began (``held``); ``steps``: how many steps of the phase ran."""

    activations: int = 0
    held: int = 0
    steps: int = 0

    @property
    def total(self) -> int:
        return self.activations + self.held


@dataclass
class WorkloadMemory:
    """One rank's step memory since tracking began: the peak of each phase that ran, and the bytes the steps
    hold now (``held``, between steps: a tensor a step created and something kept alive)."""

    peaks: dict[str, PhasePeak] = field(default_factory=dict)
    held: int = 0

    @property
    def steps(self) -> int:
        return sum(peak.steps for peak in self.peaks.values())

    def to_dict(self) -> dict[str, Any]:
        return {"peaks": {phase: {**asdict(peak), "total": peak.total} for phase, peak in self.peaks.items()},
                "held": self.held, "steps": self.steps}


class StepMemoryTracker:
    """Measures each step it runs (``step``); ``report()`` is the rank's WorkloadMemory so far.

    ``existing``: the tensors that are not the steps' (weights, buffers, KV cache), not counted on CPU.
    """

    def __init__(self, device: torch.device, existing: Any = ()) -> None:
        self.device = device
        self.peaks: dict[str, PhasePeak] = {}
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            self._base = torch.cuda.memory_allocated(device)
        else:
            self._tracker = ActivationTracker(existing)

    def held(self) -> int:
        """Bytes the steps allocated that are still allocated now."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            return torch.cuda.memory_allocated(self.device) - self._base
        return self._tracker.current_bytes

    def step(self, phase: str, fn: Callable[[], T], count: bool = True) -> T:
        """Run one step of ``phase`` (one of PHASES) and record its peak; ``count=False``: a part of the step that
        ran last (an engine that samples in a call of its own), measured but not counted again."""
        if phase not in PHASES:
            raise ValueError(f"unknown step phase {phase!r}; use one of {', '.join(PHASES)}")
        held = self.held()
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
            result = fn()
            torch.cuda.synchronize(self.device)
            activations = torch.cuda.max_memory_allocated(self.device) - self._base - held
        else:
            self._tracker.peak_bytes = held  # this step's high-water mark, from what it starts with
            with self._tracker:
                result = fn()
            activations = self._tracker.peak_bytes - held
        peak = self.peaks.setdefault(phase, PhasePeak())
        if held + activations > peak.total:
            peak.activations, peak.held = activations, held
        peak.steps += count
        return result

    def report(self) -> WorkloadMemory:
        return WorkloadMemory({phase: PhasePeak(p.activations, p.held, p.steps) for phase, p in self.peaks.items()},
                              self.held())
