"""Engine configuration: the validated EngineConfig workers get, and its sub-configs.

EngineArgs (engine/arg_utils.py) builds it from what users pass. Every check raises ConfigError
naming the field, the bad value and the fix. Nothing here imports torch at module level or touches
a device.

One module per config, as in vLLM: ``model`` (ModelConfig, from ``hf_config``'s HFConfig, a parsed
config.json), ``parallel`` (ParallelConfig, and the tensor parallel sizes that split a model),
``cache``, ``load``, ``device``, ``scheduler``, and ``engine`` (EngineConfig, which holds them all);
``utils`` holds the checks they share.
"""

from engine_ref.config.cache import CacheConfig
from engine_ref.config.device import DeviceConfig
from engine_ref.config.engine import EngineConfig
from engine_ref.config.hf_config import HFConfig, get_text_config
from engine_ref.config.load import LoadConfig
from engine_ref.config.model import ModelConfig
from engine_ref.config.parallel import (
    ParallelConfig,
    tensor_parallel_dims,
    valid_tensor_parallel_sizes,
    verify_tensor_parallel_size,
)
from engine_ref.config.scheduler import SchedulerConfig

__all__ = [
    "CacheConfig", "DeviceConfig", "EngineConfig", "HFConfig", "LoadConfig", "ModelConfig", "ParallelConfig",
    "SchedulerConfig", "get_text_config", "tensor_parallel_dims", "valid_tensor_parallel_sizes",
    "verify_tensor_parallel_size",
]
