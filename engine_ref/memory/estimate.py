"""Will this model fit on that device at this TP size? Answered from config.json alone, in seconds.

``estimate_memory`` runs the engine's own startup code for every rank on fake tensors (shapes
without storage) under a simulated tensor-parallel group (``fake_engine.py``), so nothing
full-size is ever allocated, and returns a MemoryEstimate: per-rank weights, activation peak of the
profile run and KV bytes per token, the KV blocks the engine would allocate, and whether one request
of max_model_len fits (if not: which category overflows, and the largest max_model_len that fits).

Because the code is the engine's, the estimate of a tiny checkpoint equals what the engine measures
when it starts on it, to the byte on CPU (``compare_with_report``, tests/test_estimate.py).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from engine_ref.config import EngineConfig
from engine_ref.engine.arg_utils import EngineArgs
from engine_ref.errors import ConfigError
from engine_ref.memory.compare import EstimateComparison, MemoryDifference, compare_with_report
from engine_ref.utils import format_bytes

if TYPE_CHECKING:
    from engine_ref.model_executor.models.registry import _ModelRegistry

__all__ = ["JSON_KEYS", "EstimateComparison", "MemoryDifference", "MemoryEstimate", "compare_with_report",
           "estimate_memory"]

#: The keys of ``MemoryEstimate.to_dict()`` (and of ``engine-ref estimate --json``), in order.
JSON_KEYS = (
    "architecture", "num_parameters", "dtype", "tensor_parallel_size", "weight_bytes", "weight_bytes_per_rank",
    "activation_peak_bytes_per_rank", "kv_cache_bytes_per_token_per_rank", "block_size", "num_gpu_blocks",
    "max_concurrency", "fits", "reason", "max_model_len_estimate",
)

#: Device memory by category, in the order a rank claims it; ``MemoryEstimate.overflow`` is one of them.
CATEGORIES = ("weights", "activation_peak", "kv_cache")


@dataclass
class MemoryEstimate:
    """The predicted memory of every rank of an engine, and whether max_model_len fits.

    Figures are bytes, counted as the engine counts them. ``weight_bytes`` is the whole model as
    one rank would hold it at TP=1 (parameters and buffers, a tied tensor once); ``*_per_rank`` lists
    have one entry per rank. ``num_gpu_blocks`` is the KV cache the engine would allocate (the most
    constrained rank decides), ``max_concurrency`` how many requests of ``max_model_len`` tokens it
    holds. When ``fits`` is false, ``overflow`` names the category that does not fit (one of
    CATEGORIES), ``reason`` says why and what to change, and ``max_model_len_estimate`` is the
    largest max_model_len that fits, verified by re-running the profile at that length (0: none
    does, among the lengths searched; see fake_engine.MAX_SEARCH_SEQUENCES). When it fits,
    ``max_model_len_estimate`` is the requested max_model_len.

    ``all_reduce_bytes`` is one all-reduced activation of the profile run (max_num_batched_tokens x
    hidden_size), 0 at TP=1. A real multi-rank run can measure a peak up to that much higher than
    the estimate: a collective backend may drop its reference to the tensor it reduced a moment
    after returning (gloo releases it from its worker thread), so the tensor can outlive the next
    allocation. The estimate is the peak when it does not.
    """

    architecture: str
    num_parameters: int
    dtype: str
    tensor_parallel_size: int
    weight_bytes: int
    weight_bytes_per_rank: list[int]
    activation_peak_bytes_per_rank: list[int]
    kv_cache_bytes_per_token_per_rank: list[int]
    block_size: int
    num_gpu_blocks: int
    max_concurrency: float
    fits: bool
    reason: str | None
    max_model_len_estimate: int
    # the inputs the figures depend on (not in the JSON, which has exactly JSON_KEYS)
    max_model_len: int = 0
    max_num_batched_tokens: int = 0
    device_memory_bytes: int = 0
    gpu_memory_utilization: float = 0.9
    overflow: str | None = None
    all_reduce_bytes: int = 0
    seconds: float = field(default=0.0, compare=False)

    @property
    def budget_bytes(self) -> int:
        """Device memory the engine may use on each rank: capacity * gpu_memory_utilization."""
        return int(self.device_memory_bytes * self.gpu_memory_utilization)

    @property
    def kv_cache_bytes_per_rank(self) -> list[int]:
        """The KV cache each rank would allocate: num_gpu_blocks blocks of block_size tokens."""
        return [self.num_gpu_blocks * self.block_size * b for b in self.kv_cache_bytes_per_token_per_rank]

    def to_dict(self) -> dict[str, Any]:
        """The JSON of ``engine-ref estimate --json``: exactly the keys in JSON_KEYS."""
        return {key: getattr(self, key) for key in JSON_KEYS}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    def format_table(self) -> str:
        """A readable summary: the verdict, then one row of bytes per rank."""
        verdict = "fits" if self.fits else f"does NOT fit: {self.reason}"
        lines = [
            f"{self.architecture}: {self.num_parameters:,} parameters, {format_bytes(self.weight_bytes)} in "
            f"{self.dtype}",
            f"tensor_parallel_size={self.tensor_parallel_size} device_memory={format_bytes(self.device_memory_bytes)} "
            f"gpu_memory_utilization={self.gpu_memory_utilization} max_model_len={self.max_model_len} "
            f"max_num_batched_tokens={self.max_num_batched_tokens}",
            "",
            f"{'rank':<6}{'weights':>12}{'activations':>13}{'KV/token':>11}{'KV cache':>12}{'total':>12}"
            f"{'budget':>12}",
        ]
        for rank in range(self.tensor_parallel_size):
            weights, peak = self.weight_bytes_per_rank[rank], self.activation_peak_bytes_per_rank[rank]
            kv = self.kv_cache_bytes_per_rank[rank]
            lines.append(
                f"{rank:<6}{format_bytes(weights):>12}{format_bytes(peak):>13}"
                f"{self.kv_cache_bytes_per_token_per_rank[rank]:>9} B{format_bytes(kv):>12}"
                f"{format_bytes(weights + peak + kv):>12}{format_bytes(self.budget_bytes):>12}"
            )
        lines += [
            "",
            f"KV cache: {self.num_gpu_blocks} blocks of {self.block_size} tokens; max concurrency at "
            f"max_model_len {self.max_model_len}: {self.max_concurrency:.2f}x",
            f"verdict: {verdict}",
        ]
        if not self.fits:
            lines.append(f"largest max_model_len that fits: {self.max_model_len_estimate}")
        return "\n".join(lines)


def estimate_memory(
    config: str | os.PathLike[str] | Mapping[str, Any],
    *,
    device_memory: str | int,
    tensor_parallel_size: int = 1,
    dtype: str = "auto",
    gpu_memory_utilization: float = 0.9,
    max_model_len: int | None = None,
    max_num_batched_tokens: int | None = None,
    block_size: int = 16,
    registry: _ModelRegistry | None = None,
) -> MemoryEstimate:
    """Predict each rank's weights, activation peak and KV cache, and whether max_model_len fits.

    ``config``: a model directory, a config.json file (any name), or the parsed dict.
    ``device_memory``: each rank's device capacity, e.g. "80GiB" or a byte count.
    The other arguments mean what they mean to the engine (``EngineArgs``), with the same
    defaults: max_model_len defaults to max_position_embeddings, max_num_batched_tokens to
    max(max_model_len, 2048). ``registry`` defaults to engine_ref's ModelRegistry.

    Raises ConfigError (or a subclass: UnknownArchitectureError, MissingConfigField) for bad input.
    """
    from engine_ref.memory.fake_engine import FakeEngine
    from engine_ref.model_executor.models.registry import ModelRegistry
    from engine_ref.plugins import load_general_plugins

    start = time.perf_counter()
    if device_memory is None:
        raise ConfigError("device_memory is required: each rank's device capacity, e.g. '80GiB'.")
    load_general_plugins()
    registry = registry or ModelRegistry
    with _model_directory(config) as (model_dir, label):
        engine_config = _engine_config(model_dir, label, registry, device_memory=device_memory,
                                       tensor_parallel_size=tensor_parallel_size, dtype=dtype,
                                       gpu_memory_utilization=gpu_memory_utilization, max_model_len=max_model_len,
                                       max_num_batched_tokens=max_num_batched_tokens, block_size=block_size)
        estimate = FakeEngine(engine_config, label, max_num_batched_tokens).estimate()
    estimate.seconds = time.perf_counter() - start
    return estimate


# -- the input: a directory the engine's ModelConfig can read --------------------------------------


@contextmanager
def _model_directory(config: str | os.PathLike[str] | Mapping[str, Any]) -> Iterator[tuple[Path, str]]:
    """(a directory holding config.json, what messages call it). A file or dict is copied to a temp dir."""
    if isinstance(config, Mapping):
        try:
            text = json.dumps(dict(config))
        except (TypeError, ValueError) as e:
            raise ConfigError(f"the config dict is not JSON-serializable ({e}); pass plain JSON values.") from None
        with tempfile.TemporaryDirectory(prefix="engine_ref-estimate-") as tmp:
            (Path(tmp) / "config.json").write_text(text)
            yield Path(tmp), "the config dict"
        return
    path = Path(config)
    if path.is_dir():
        yield path, str(path)
        return
    if not path.is_file():
        raise ConfigError(f"{str(config)!r} is neither a config.json file nor a model directory; check the path.")
    if path.name == "config.json":
        yield path.parent, str(path.parent)
        return
    with tempfile.TemporaryDirectory(prefix="engine_ref-estimate-") as tmp:
        shutil.copyfile(path, Path(tmp) / "config.json")
        yield Path(tmp), str(path)


def _engine_config(model_dir: Path, label: str, registry: _ModelRegistry, **engine_args: Any) -> EngineConfig:
    """The EngineConfig the engine would validate for these arguments (load_format 'dummy', on CPU)."""
    args = EngineArgs(str(model_dir), load_format="dummy", device="cpu", **engine_args)
    try:
        return args.create_engine_config(registry, inspect_in_subprocess=False)
    except ConfigError as e:
        if label == str(model_dir):
            raise
        message = str(e).replace(str(model_dir / "config.json"), label).replace(str(model_dir), label)
        raise type(e)(message) from None  # it names the user's file, not the temporary copy
