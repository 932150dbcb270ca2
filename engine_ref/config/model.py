"""ModelConfig: which model to run, its dtype and context length, read from its config.json."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from engine_ref.config.hf_config import HFConfig, get_text_config
from engine_ref.config.utils import MAX_TOKENS_LIMIT, positive_int
from engine_ref.errors import ConfigError, MissingConfigField

if TYPE_CHECKING:
    import torch

DTYPES = {
    "float32": "float32", "float": "float32", "fp32": "float32",
    "float16": "float16", "half": "float16", "fp16": "float16",
    "bfloat16": "bfloat16", "bf16": "bfloat16",
}
DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}


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
            positive_int(f"config.json {name}", text[name])
        kv_heads = text.get("num_key_value_heads") or text["num_attention_heads"]
        if text["num_attention_heads"] % kv_heads:
            raise ConfigError(
                f"{config_path}: num_attention_heads={text['num_attention_heads']} is not a multiple of "
                f"num_key_value_heads={kv_heads}; grouped-query attention needs whole groups, fix config.json."
            )
        max_position = text.get("max_position_embeddings")
        if max_position is not None:
            positive_int(f"{config_path}: max_position_embeddings", max_position, MAX_TOKENS_LIMIT)
        if max_model_len is None:
            if max_position is None:
                raise ConfigError(
                    f"{config_path} has no max_position_embeddings; pass max_model_len explicitly."
                )
            max_model_len = max_position
        positive_int("max_model_len", max_model_len, MAX_TOKENS_LIMIT)
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
