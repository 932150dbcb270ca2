"""Will this model fit on that device at this TP size? Answered from config.json alone, in seconds.

``estimate_memory`` runs the engine's own startup code for every rank on fake tensors (shapes
without storage) under a simulated tensor-parallel group (``fake_engine.py``), so nothing
full-size is ever allocated, and returns a MemoryEstimate: per-rank weights, activation peak of the
profile run and KV bytes per token, the KV blocks the engine would allocate, and whether one request
of max_model_len fits (if not: which category overflows, and the largest max_model_len that fits).

Because the code is the engine's, the estimate of a tiny checkpoint equals what the engine measures
when it starts on it, to the byte on CPU (``compare.compare_with_report``, tests/test_estimate.py).

Quantization (``quantization="fp8"|"int8"``, or a checkpoint's ``quantization_config``) changes the
weights only: each linear layer's and expert's weight at 1 byte per parameter plus its float32
scales; embeddings, norms and the LM head stay in the model dtype; activations and the KV cache
stay in the model dtype too. For example, Llama-3-8B (``models/configs/Meta-Llama-3-8B.json``,
bfloat16, max_model_len 8192) at TP 1 on a 16 GiB device (budget 0.9 x 16 GiB = 14.40 GiB):
unquantized, its 14.96 GiB of weights alone exceed the budget, so it does not fit. With fp8 the
6.98e9 linear weights take 1 byte each and the 1.05e9 embedding and LM-head parameters 2, 8.46 GiB
in all (plus 224 per-tensor scales of 4 B); with the 1.13 GiB activation peak of the 8192-token
profile run, 4.82 GiB are left for the KV cache (128 KiB per token): 2466 blocks of 16 tokens,
4.82 requests of 8192 tokens, so it fits (int8: 5.25 MiB of per-channel scales, 2463 blocks).
The figures are what a rank holds once loaded. Converting at startup (``quantization="fp8"`` on
the bfloat16 checkpoint), a rank first holds every weight in bfloat16 (14.96 GiB here, as in
vLLM), then converts layer by layer with float32 temporaries of one weight (gate_up_proj: 0.44 GiB
each). That load-time peak is not in the estimate; here it exceeds the budget and nears the whole
16 GiB. A pre-quantized checkpoint (``engine-ref make-checkpoint ARCH DIR --quantization fp8``)
never holds it.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from engine_ref.config import EngineConfig
from engine_ref.engine.arg_utils import EngineArgs
from engine_ref.errors import ConfigError
from engine_ref.isolation.tempdirs import owner_dir

if TYPE_CHECKING:
    from engine_ref.memory.result import MemoryEstimate
    from engine_ref.model_executor.models.registry import _ModelRegistry


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
    enable_lora: bool = False,
    max_loras: int = 1,
    max_lora_rank: int = 16,
    lora_dtype: str = "auto",
    quantization: str | None = None,
    registry: _ModelRegistry | None = None,
) -> MemoryEstimate:
    """Predict each rank's weights, buffers, activation peak and KV cache, and whether max_model_len fits.

    ``config``: a model directory, a config.json file (any name), or the parsed dict.
    ``device_memory``: each rank's device capacity, e.g. "80GiB" or a byte count.
    The other arguments mean what they mean to the engine (``EngineArgs``), with the same
    defaults: max_model_len defaults to max_position_embeddings, max_num_batched_tokens to
    ``kv_cache.sizing.default_max_num_batched_tokens(max_model_len)``; with ``enable_lora`` each rank
    also holds ``max_loras`` LoRA slots of ``max_lora_rank`` (the ``lora`` category). ``quantization``
    (or config.json's ``quantization_config``): the weights the engine keeps after converting them, 1 byte
    per 8-bit weight plus float32 scales (module docstring). ``registry`` defaults to engine_ref's
    ModelRegistry.

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
                                       max_num_batched_tokens=max_num_batched_tokens, block_size=block_size,
                                       enable_lora=enable_lora, max_loras=max_loras, max_lora_rank=max_lora_rank,
                                       lora_dtype=lora_dtype, quantization=quantization)
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
        with tempfile.TemporaryDirectory(prefix="estimate-", dir=owner_dir()) as tmp:
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
    with tempfile.TemporaryDirectory(prefix="estimate-", dir=owner_dir()) as tmp:
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
