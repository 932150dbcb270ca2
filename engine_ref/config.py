"""Engine configuration: the validated EngineConfig workers get, and its sub-configs.

EngineArgs (engine/arg_utils.py) builds it from what users pass. Every check raises ConfigError
naming the field, the bad value and the fix. Nothing here imports torch at module level or touches
a device.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from engine_ref import envs
from engine_ref.errors import ConfigError, MissingConfigField
from engine_ref.kv_cache.sizing import default_max_num_batched_tokens
from engine_ref.utils import cdiv, format_bytes, host_memory_bytes, parse_size, read_json

if TYPE_CHECKING:
    import torch

    from engine_ref.lora.config import LoRAConfig
    from engine_ref.model_executor.layers.quantization.base_config import QuantizationConfig
    from engine_ref.model_executor.models.interfaces import ModelInfo

ConfigT = TypeVar("ConfigT", bound=Mapping[str, Any])

DTYPES = {
    "float32": "float32", "float": "float32", "fp32": "float32",
    "float16": "float16", "half": "float16", "fp16": "float16",
    "bfloat16": "bfloat16", "bf16": "bfloat16",
}
DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}
LOAD_FORMATS = ("safetensors", "dummy", "pt")
DEVICES = ("cpu", "cuda")
EXECUTOR_BACKENDS = ("uni", "mp", "ray")
DEFAULT_CPU_DEVICE_MEMORY = "4GiB"
DEFAULT_READY_TIMEOUT_S = 300.0
DEFAULT_RPC_TIMEOUT_S = 300.0
DEFAULT_COLLECTIVE_TIMEOUT_S = 300.0
#: The most tokens a context (max_model_len, max_position_embeddings) or a batch may hold: above any published model.
MAX_TOKENS_LIMIT = 2**24
CONFIG_JSON_MAX_BYTES = 16 * 1024**2  # published config.json files are a few KiB
CONFIG_JSON_MAX_DEPTH = 32


# transformers' ``attribute_map`` of each bundled model type: an alias config.json may use -> the name
# the config class stores (Qwen3-MoE's Hub files say num_experts, transformers 5 writes
# num_local_experts). tests/test_models_hf.py proves it equals transformers' own.
HF_ATTRIBUTE_MAPS: dict[str, dict[str, str]] = {
    "mixtral": {"num_experts": "num_local_experts"},
    "qwen3_moe": {"num_experts": "num_local_experts"},
    "llava": {"image_token_id": "image_token_index"},
}


class HFConfig(dict):
    """A parsed config.json: a dict whose keys also read as attributes.

    As in transformers' config classes, an alias of the model type's ``HF_ATTRIBUTE_MAPS`` is stored
    under its canonical name and reads under either. A missing key raises MissingConfigField (an
    AttributeError too), so ``getattr(c, k, default)`` works and a model that needs a field gets a
    message naming it.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        for alias, name in self._aliases().items():
            if not super().__contains__(alias):
                continue
            value = super().pop(alias)
            if super().get(name, value) != value:
                raise ConfigError(
                    f"config.json sets both {alias}={value!r} and {name}={super().__getitem__(name)!r}, two "
                    f"spellings of one field; keep one."
                )
            super().__setitem__(name, value)

    def _aliases(self) -> dict[str, str]:
        return HF_ATTRIBUTE_MAPS.get(dict.get(self, "model_type") or "", {})

    def _key(self, name: Any) -> Any:
        return self._aliases().get(name, name)

    def __getitem__(self, name: Any) -> Any:
        return super().__getitem__(self._key(name))

    def __contains__(self, name: object) -> bool:
        return super().__contains__(self._key(name))

    def get(self, name: Any, default: Any = None) -> Any:
        return super().get(self._key(name), default)

    def __getattr__(self, name: str) -> Any:
        try:
            return self[name]
        except KeyError:
            raise MissingConfigField(
                f"config.json has no field {name!r}, which this architecture needs; add it to config.json."
            ) from None

    def __getstate__(self) -> dict:
        return dict(self)

    def __setstate__(self, state: dict) -> None:
        self.update(state)

    @classmethod
    def from_file(cls, path: Path) -> HFConfig:
        """Read a config.json: a JSON object of at most CONFIG_JSON_MAX_BYTES, nested at most CONFIG_JSON_MAX_DEPTH."""
        try:
            config = read_json(path, max_bytes=CONFIG_JSON_MAX_BYTES, max_depth=CONFIG_JSON_MAX_DEPTH,
                               object_hook=cls)
        except ConfigError as e:
            raise ConfigError(f"{path}: {e}") from None
        except (ValueError, OSError) as e:
            raise ConfigError(f"{path} is not valid JSON for a config.json ({e}); fix or regenerate "
                              f"config.json.") from None
        if not isinstance(config, HFConfig):
            raise ConfigError(f"{path} holds a JSON {type(config).__name__}, not an object; config.json must be "
                              f"one JSON object such as {{\"architectures\": [\"LlamaForCausalLM\"], ...}}.")
        return config


def get_text_config(hf_config: ConfigT) -> ConfigT:
    """The language model's config: ``text_config`` for multimodal models, else the config itself."""
    return hf_config.get("text_config") or hf_config


def _positive_int(name: str, value: Any, limit: int | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConfigError(f"{name}={value!r} must be a positive integer.")
    if limit is not None and value > limit:
        raise ConfigError(f"{name}={value} is larger than engine_ref supports (at most {limit}); lower it.")


def _seconds(name: str, value: Any, from_env: Callable[[], float | None], default: float) -> float:
    """``value``, else its environment variable, else ``default``: a finite positive number of seconds."""
    if value is None:
        value = from_env() or default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
        raise ConfigError(f"{name}={value!r} must be a finite positive number of seconds.")
    return float(value)


@dataclass(init=False)
class ModelConfig:
    """Which model to run: a Hugging Face layout directory, its dtype and context length, and its
    weight quantization (the method asked for; once EngineArgs resolved it, the method in use).

    ``max_model_len=None`` means config.json's max_position_embeddings; once built, it is always set.
    """

    model: str
    dtype: str
    max_model_len: int
    seed: int
    quantization: str | None
    hf_config: HFConfig = field(repr=False)
    architecture: str

    def __init__(self, model: str, dtype: str = "auto", max_model_len: int | None = None, seed: int = 0,
                 quantization: str | None = None) -> None:
        self.model, self.dtype, self.seed, self.quantization = model, dtype, seed, quantization
        path = Path(self.model)
        if not path.is_dir():
            raise ConfigError(
                f"model={self.model!r} is not a directory; pass a Hugging Face layout directory "
                f"(config.json + *.safetensors), e.g. one written by `engine-ref make-checkpoint ARCH DIR`."
            )
        config_path = path / "config.json"
        if not config_path.is_file():
            raise ConfigError(f"model={self.model!r} has no config.json; a model directory needs config.json.")
        self.hf_config = HFConfig.from_file(config_path)
        archs = self.hf_config.get("architectures")
        if not archs or not isinstance(archs, list) or not all(isinstance(a, str) for a in archs):
            raise ConfigError(
                f"{config_path} has no 'architectures' list; add e.g. \"architectures\": [\"LlamaForCausalLM\"]."
            )
        self.architecture = archs[0]
        self.dtype = self._resolve_dtype()
        text = get_text_config(self.hf_config)
        for name in ("hidden_size", "num_attention_heads", "num_hidden_layers", "vocab_size"):
            if name not in text:
                raise MissingConfigField(
                    f"{config_path} lacks {name!r}, which every language model needs; add it to config.json."
                )
            _positive_int(f"config.json {name}", text[name])
        kv_heads = text.get("num_key_value_heads") or text["num_attention_heads"]
        if text["num_attention_heads"] % kv_heads:
            raise ConfigError(
                f"{config_path}: num_attention_heads={text['num_attention_heads']} is not a multiple of "
                f"num_key_value_heads={kv_heads}; grouped-query attention needs whole groups, fix config.json."
            )
        max_position = text.get("max_position_embeddings")
        if max_position is not None:
            _positive_int(f"{config_path}: max_position_embeddings", max_position, MAX_TOKENS_LIMIT)
        if max_model_len is None:
            if max_position is None:
                raise ConfigError(
                    f"{config_path} has no max_position_embeddings; pass max_model_len explicitly."
                )
            max_model_len = max_position
        _positive_int("max_model_len", max_model_len, MAX_TOKENS_LIMIT)
        self.max_model_len = max_model_len
        if max_position is not None and self.max_model_len > max_position:
            raise ConfigError(
                f"max_model_len={self.max_model_len} exceeds max_position_embeddings={max_position} of "
                f"{self.model}; lower max_model_len to at most {max_position}."
            )

    def _resolve_dtype(self) -> str:
        requested = str(self.dtype).removeprefix("torch.")
        if requested == "auto":
            requested = str(self.hf_config.get("torch_dtype") or self.hf_config.get("dtype") or "float32")
            requested = requested.removeprefix("torch.")
        if requested not in DTYPES:
            if str(self.dtype).removeprefix("torch.") == "auto":  # the bad value came from config.json
                raise ConfigError(
                    f"dtype='auto' resolves to config.json's dtype {requested!r}, which is not supported; "
                    f"pass dtype as one of float32, float16, bfloat16."
                )
            raise ConfigError(
                f"dtype={self.dtype!r} is not supported; use one of auto, float32, float16, bfloat16."
            )
        return DTYPES[requested]

    @property
    def hf_text_config(self) -> HFConfig:
        return get_text_config(self.hf_config)

    @property
    def torch_dtype(self) -> torch.dtype:
        import torch

        return getattr(torch, self.dtype)

    @property
    def num_attention_heads(self) -> int:
        return self.hf_text_config.num_attention_heads

    @property
    def num_key_value_heads(self) -> int:
        return self.hf_text_config.get("num_key_value_heads") or self.num_attention_heads

    @property
    def head_dim(self) -> int:
        text = self.hf_text_config
        return text.get("head_dim") or text.hidden_size // text.num_attention_heads

    @property
    def num_hidden_layers(self) -> int:
        return self.hf_text_config.num_hidden_layers


@dataclass(init=False)
class ParallelConfig:
    """How the model is split: tensor parallel size and the executor that runs the ranks.

    Left as None, the backend becomes 'uni' for one rank and 'mp' for more, and each timeout its
    ENGINE_REF_* environment variable, else 300 s; once built, all are set.
    """

    tensor_parallel_size: int
    distributed_executor_backend: str
    ready_timeout_s: float  # workers' startup, and the rendezvous of the process group
    rpc_timeout_s: float  # each call to the workers after startup (a generate step)
    collective_timeout_s: float  # each collective of the TP group (gloo/nccl)

    def __init__(self, tensor_parallel_size: int = 1, distributed_executor_backend: str | None = None,
                 ready_timeout_s: float | None = None, rpc_timeout_s: float | None = None,
                 collective_timeout_s: float | None = None) -> None:
        _positive_int("tensor_parallel_size", tensor_parallel_size)
        self.tensor_parallel_size = tensor_parallel_size
        if distributed_executor_backend is None:
            distributed_executor_backend = "uni" if tensor_parallel_size == 1 else "mp"
        if distributed_executor_backend not in EXECUTOR_BACKENDS:
            raise ConfigError(
                f"distributed_executor_backend={distributed_executor_backend!r} is unknown; "
                f"use one of {', '.join(EXECUTOR_BACKENDS)}."
            )
        if distributed_executor_backend == "uni" and tensor_parallel_size > 1:
            raise ConfigError(
                f"distributed_executor_backend='uni' runs one rank, but tensor_parallel_size="
                f"{tensor_parallel_size}; use 'mp' or 'ray', or tensor_parallel_size=1."
            )
        self.distributed_executor_backend = distributed_executor_backend
        self.ready_timeout_s = _seconds("ready_timeout_s", ready_timeout_s, envs.ready_timeout_s,
                                        DEFAULT_READY_TIMEOUT_S)
        self.rpc_timeout_s = _seconds("rpc_timeout_s", rpc_timeout_s, envs.rpc_timeout_s, DEFAULT_RPC_TIMEOUT_S)
        self.collective_timeout_s = _seconds("collective_timeout_s", collective_timeout_s,
                                             envs.collective_timeout_s, DEFAULT_COLLECTIVE_TIMEOUT_S)

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size


@dataclass
class CacheConfig:
    """How the KV cache is sized: block size and the share of device memory the engine may use."""

    block_size: int = 16
    gpu_memory_utilization: float = 0.9
    num_gpu_blocks_override: int | None = None

    def __post_init__(self) -> None:
        _positive_int("block_size", self.block_size)
        if not isinstance(self.gpu_memory_utilization, (int, float)) or not 0 < self.gpu_memory_utilization <= 1:
            raise ConfigError(
                f"gpu_memory_utilization={self.gpu_memory_utilization!r} must be in (0, 1], "
                f"the fraction of device memory the engine may use (e.g. 0.9)."
            )
        if self.num_gpu_blocks_override is not None:
            _positive_int("num_gpu_blocks_override", self.num_gpu_blocks_override)


@dataclass
class LoadConfig:
    """How weights are read: safetensors (HF layout), dummy (random, no files) or pt (weights_only)."""

    load_format: str = "safetensors"

    def __post_init__(self) -> None:
        if self.load_format not in LOAD_FORMATS:
            raise ConfigError(f"load_format={self.load_format!r} is unknown; use one of {', '.join(LOAD_FORMATS)}.")


@dataclass
class DeviceConfig:
    """The device and its memory. On CPU the memory is simulated: a capacity such as "8GiB"."""

    device: str = "cpu"
    device_memory: str | int | None = None
    capacity_bytes: int | None = field(init=False, default=None)

    def __post_init__(self) -> None:
        if self.device not in DEVICES:
            raise ConfigError(f"device={self.device!r} is unknown; use 'cpu' or 'cuda'.")
        if self.device == "cpu" and self.device_memory is None:
            self.device_memory = DEFAULT_CPU_DEVICE_MEMORY
        if self.device_memory is not None:
            self.capacity_bytes = parse_size(self.device_memory, "device_memory")


@dataclass(init=False)
class SchedulerConfig:
    """Batch limits: tokens per step (also the profile run's size) and sequences per step.

    ``max_num_batched_tokens=None`` means ``default_max_num_batched_tokens(max_model_len)``; either way
    a full-length prompt must fit one step. Once built, it is always set.
    """

    max_num_batched_tokens: int
    max_num_seqs: int

    def __init__(self, max_model_len: int, max_num_batched_tokens: int | None = None, max_num_seqs: int = 64) -> None:
        if max_num_batched_tokens is None:
            max_num_batched_tokens = default_max_num_batched_tokens(max_model_len)
        _positive_int("max_num_batched_tokens", max_num_batched_tokens, MAX_TOKENS_LIMIT)
        _positive_int("max_num_seqs", max_num_seqs)
        if max_num_batched_tokens < max_model_len:
            raise ConfigError(
                f"max_num_batched_tokens={max_num_batched_tokens} is smaller than max_model_len="
                f"{max_model_len}, so a full-length prompt could never be scheduled; raise "
                f"max_num_batched_tokens to at least {max_model_len} or lower max_model_len."
            )
        self.max_num_batched_tokens, self.max_num_seqs = max_num_batched_tokens, max_num_seqs


@dataclass
class EngineConfig:
    """Everything an engine and its workers need, validated across fields."""

    model_config: ModelConfig
    parallel_config: ParallelConfig
    cache_config: CacheConfig
    load_config: LoadConfig
    device_config: DeviceConfig
    scheduler_config: SchedulerConfig
    lora_config: LoRAConfig | None = None  # None: LoRA not enabled
    quant_config: QuantizationConfig | None = None  # None: unquantized weights
    model_info: ModelInfo | None = None

    def __post_init__(self) -> None:
        verify_tensor_parallel_size(self.model_config, self.parallel_config.tensor_parallel_size)
        if self.device_config.device == "cuda":
            import torch

            if not torch.backends.cuda.is_built():
                raise ConfigError(
                    f"device='cuda' but this torch build ({torch.__version__}) has no CUDA; use device='cpu'."
                )

    def verify_device_memory(self) -> None:
        """Before any worker starts: refuse sizes that cannot fit one rank's device, whatever the profile run finds.

        Each need is a lower bound of what a rank allocates (the embedding shard, the profile batch's
        hidden states, one max_model_len request's KV cache, an explicit block count), so a ConfigError
        here is certain, and comes in milliseconds rather than as a MemoryError from the workers.
        On CPU the simulated device memory must also exist in this host, which backs it.
        """
        capacity = self.device_config.capacity_bytes
        if capacity is None:  # CUDA without device_memory: the worker reads the GPU's own
            return
        if self.device_config.device == "cpu" and capacity > (host := host_memory_bytes()):
            raise ConfigError(
                f"device_memory={self.device_config.device_memory!r} ({format_bytes(capacity)}) exceeds this host's "
                f"memory ({format_bytes(host)}), which holds the simulated CPU device; lower device_memory "
                f"(--device-memory) to at most {format_bytes(host)}.")
        model, tp = self.model_config, self.parallel_config.tensor_parallel_size
        text, itemsize = model.hf_text_config, DTYPE_BYTES[model.dtype]
        block_size = self.cache_config.block_size
        block_bytes = (2 * block_size * max(1, model.num_key_value_heads // tp) * model.head_dim * itemsize
                       * model.num_hidden_layers)
        budget = int(capacity * self.cache_config.gpu_memory_utilization)
        tokens = self.scheduler_config.max_num_batched_tokens
        needs = [
            (cdiv(text.vocab_size, tp) * text.hidden_size * itemsize,
             f"config.json's vocab_size={text.vocab_size} x hidden_size={text.hidden_size} (the embedding, "
             f"{'split over' if tp > 1 else 'on'} {tp} rank(s))", "the model does not fit: raise tensor_parallel_size"),
            (tokens * text.hidden_size * itemsize,
             f"max_num_batched_tokens={tokens} (the profile run's batch) x hidden_size={text.hidden_size}",
             "lower max_num_batched_tokens and max_model_len"),
            (cdiv(model.max_model_len, block_size) * block_bytes,
             f"max_model_len={model.max_model_len} (one request's KV cache)",
             f"lower max_model_len to at most {budget // block_bytes * block_size}"),
        ]
        if self.cache_config.num_gpu_blocks_override is not None:
            blocks = self.cache_config.num_gpu_blocks_override
            needs.append((blocks * block_bytes, f"num_gpu_blocks_override={blocks} (KV blocks)",
                          f"lower num_gpu_blocks_override to at most {budget // block_bytes}"))
        for need, what, fix in needs:
            if need > budget:
                utilization = self.cache_config.gpu_memory_utilization
                raise ConfigError(
                    f"{what} needs {format_bytes(need)} per rank, more than the {utilization} x "
                    f"{format_bytes(capacity)} of device memory it may use; {fix}, or raise device_memory.")


def tensor_parallel_dims(hf_config: Mapping[str, Any]) -> dict[str, int]:
    """The sizes tensor parallelism splits evenly: attention heads and MLP widths, text and vision."""
    text = get_text_config(hf_config)
    dims = {"num_attention_heads": text["num_attention_heads"]}
    for key in ("intermediate_size", "moe_intermediate_size"):
        if isinstance(text.get(key), int):
            dims[key] = text[key]
    vision = hf_config.get("vision_config") or {}
    for key in ("num_attention_heads", "intermediate_size"):
        if isinstance(vision.get(key), int):
            dims[f"vision_config.{key}"] = vision[key]
    return dims


def _kv_heads_split(num_kv_heads: int, tp: int) -> bool:
    """KV heads are split over ranks, or each replicated on tp / num_kv_heads ranks."""
    return num_kv_heads % tp == 0 or tp % num_kv_heads == 0


def valid_tensor_parallel_sizes(hf_config: Mapping[str, Any], limit: int = 64) -> list[int]:
    """Every tensor_parallel_size up to ``limit`` that splits the model evenly."""
    dims = tensor_parallel_dims(hf_config)
    text = get_text_config(hf_config)
    kv_heads = text.get("num_key_value_heads") or text["num_attention_heads"]
    return [tp for tp in range(1, limit + 1)
            if all(size % tp == 0 for size in dims.values()) and _kv_heads_split(kv_heads, tp)]


def verify_tensor_parallel_size(model: ModelConfig, tp: int) -> None:
    """Raise ConfigError when tp does not split the heads (text and vision) and MLP widths evenly."""
    uneven = [f"{name}={size}" for name, size in tensor_parallel_dims(model.hf_config).items() if size % tp]
    if not _kv_heads_split(model.num_key_value_heads, tp):
        uneven.append(f"num_key_value_heads={model.num_key_value_heads} (and is not a multiple of it)")
    if uneven:
        raise ConfigError(
            f"tensor_parallel_size={tp} does not divide {' or '.join(uneven)} of {model.architecture}; "
            f"use one of {valid_tensor_parallel_sizes(model.hf_config)}."
        )
