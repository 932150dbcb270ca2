"""StartupReport: what engine startup did, per phase and per rank, as data, JSON and a table."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from typing import Any

from engine_ref.kv_cache.sizing import KVCacheSizing
from engine_ref.memory.accounting import MemoryUsage
from engine_ref.memory.workload import WorkloadMemory
from engine_ref.utils import format_bytes


@dataclass(frozen=True)
class Span:
    """One timed step: its name, its start and end on the machine's monotonic clock (comparable across
    the engine's processes), and what it did (``args``: bytes read, a file name...)."""

    name: str
    start_ns: int
    end_ns: int
    args: dict[str, Any] = field(default_factory=dict)


class PhaseTimer:
    """Records how long each named phase took, in order, and each one's span (for the startup trace)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self.spans: list[Span] = []

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        start = time.monotonic_ns()
        try:
            yield
        finally:
            end = time.monotonic_ns()
            self.seconds[name] = (end - start) / 1e9
            self.spans.append(Span(name, start, end))


@dataclass
class WorkerReport:
    """One rank: its process, how long its phases took, what it read and what memory it uses; ``workload``: the
    memory of its steps since ``Worker.track_step_memory`` (None before)."""

    rank: int
    pid: int
    device: str
    phases: dict[str, float]
    bytes_read: int
    memory: MemoryUsage
    spans: list[Span] = field(default_factory=list)  # its steps, and each file load_model read
    workload: WorkloadMemory | None = None

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "memory": self.memory.to_dict(),
                "workload": None if self.workload is None else self.workload.to_dict()}


@dataclass
class StartupReport:
    """The result of a successful engine startup; ``kv_cache`` is the sizing the engine allocated by."""

    architecture: str
    model: str
    tensor_parallel_size: int
    executor_backend: str
    kv_cache: KVCacheSizing
    phases: dict[str, float] = field(default_factory=dict)
    workers: list[WorkerReport] = field(default_factory=list)
    spans: list[Span] = field(default_factory=list)  # the engine's phases, for the startup trace
    pid: int = 0  # the engine's process

    @property
    def max_model_len(self) -> int:
        return self.kv_cache.max_model_len

    @property
    def block_size(self) -> int:
        return self.kv_cache.block_size

    @property
    def num_gpu_blocks(self) -> int:
        return self.kv_cache.num_blocks

    @property
    def total_seconds(self) -> float:
        return sum(self.phases.values())

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["workers"] = [w.to_dict() for w in self.workers]
        data.update(max_model_len=self.max_model_len, block_size=self.block_size,
                    num_gpu_blocks=self.num_gpu_blocks, total_seconds=self.total_seconds)
        return data

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    def format_table(self) -> str:
        """The phases, then one row of memory per rank (a LoRA column when the engine has LoRA slots)."""
        with_lora = any(w.memory.lora for w in self.workers)
        lora_header = f"{'LoRA':>12}" if with_lora else ""
        lines = [
            f"{self.architecture} from {self.model}",
            f"tensor_parallel_size={self.tensor_parallel_size} executor={self.executor_backend} "
            f"max_model_len={self.max_model_len} KV blocks={self.num_gpu_blocks} x {self.block_size} tokens",
            "",
            f"{'phase':<12}{'seconds':>10}",
            *(f"{name:<12}{secs:>10.3f}" for name, secs in self.phases.items()),
            f"{'total':<12}{self.total_seconds:>10.3f}",
            "",
            f"{'rank':<6}{'pid':>8}  {'device':<8}{'load s':>8}{'read':>12}{'weights':>12}"
            f"{'buffers':>12}{lora_header}{'activations':>13}{'KV cache':>12}{'total':>12}"
            f"{'capacity':>12}",
        ]
        for w in self.workers:
            m = w.memory
            lora = f"{format_bytes(m.lora):>12}" if with_lora else ""
            lines.append(
                f"{w.rank:<6}{w.pid:>8}  {w.device:<8}{w.phases.get('load_model', 0.0):>8.3f}"
                f"{format_bytes(w.bytes_read):>12}{format_bytes(m.weights):>12}"
                f"{format_bytes(m.buffers):>12}{lora}"
                f"{format_bytes(m.activation_peak):>13}{format_bytes(m.kv_cache):>12}"
                f"{format_bytes(m.total):>12}{format_bytes(m.capacity):>12}"
            )
        return "\n".join(lines)
