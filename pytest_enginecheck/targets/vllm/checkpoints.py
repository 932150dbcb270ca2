"""Tiny Hugging Face checkpoints for vLLM architectures, from transformers' own config classes.

The architecture's transformers class gives its config class; the config is built with every size
shrunk (``TINY_SIZES``: head_dim 32, since vLLM's CPU attention rejects 16), the model is built with
random weights under a fixed seed and saved in HF layout with safetensors. An architecture with no
transformers class, or whose config refuses the tiny sizes, raises NoTinyCheckpoint with the reason.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

SEED = 0
# Applied only where the config has the field; heads * head_dim == hidden_size keeps every family happy.
TINY_SIZES: dict[str, Any] = {
    "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 2,
    "num_key_value_heads": 2, "head_dim": 32, "vocab_size": 256, "max_position_embeddings": 256,
    "num_local_experts": 4, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 64,
    "shared_expert_intermediate_size": 64, "sliding_window": None, "max_window_layers": 2,
    "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": None,
}


class NoTinyCheckpoint(Exception):
    """No tiny checkpoint can be made for the architecture; the message says why."""


def tiny_sizes(fields: Mapping[str, Any]) -> dict[str, Any]:
    """The sizes a tiny config is built with, from the fields its default config has (name -> default value).

    TINY_SIZES where the config has the field; a router that picks fewer experts per token than TINY_SIZES (Llama
    4's top-1) keeps its own number; a config that lists ``layer_types`` gets one full-attention layer per layer.
    """
    sizes = {k: v for k, v in TINY_SIZES.items() if k in fields}
    if isinstance(fields.get("num_experts_per_tok"), int):
        sizes["num_experts_per_tok"] = min(fields["num_experts_per_tok"], TINY_SIZES["num_experts_per_tok"])
    if "layer_types" in fields:
        sizes["layer_types"] = ["full_attention"] * sizes.get("num_hidden_layers", 2)
    return sizes


def hf_class(architecture: str, model_cls: type | None = None) -> Any:
    """The transformers class for an architecture: its own name, else the nearest base class of the vLLM
    model class that transformers has (an out-of-tree ``MyLlama(LlamaForCausalLM)`` uses Llama's)."""
    import transformers

    names = [architecture, *(base.__name__ for base in (model_cls.__mro__ if model_cls else ()))]
    found = next((getattr(transformers, n) for n in names if isinstance(getattr(transformers, n, None), type)), None)
    if found is None:
        raise NoTinyCheckpoint(f"transformers {transformers.__version__} has no class {architecture!r} (nor one of its "
                               f"base classes), so there is no config class to shrink")
    return found


def tiny_config(architecture: str, model_cls: type | None = None) -> Any:
    """The architecture's transformers config with TINY_SIZES applied."""
    hf = hf_class(architecture, model_cls)
    config_cls = getattr(hf, "config_class", None)
    if config_cls is None:
        raise NoTinyCheckpoint(f"transformers.{architecture} declares no config_class")
    defaults = config_cls()
    if getattr(defaults, "text_config", None) is not None and defaults.text_config is not defaults:
        raise NoTinyCheckpoint(f"{config_cls.__name__} is a composite (multimodal) config; only text decoders "
                               f"get tiny checkpoints so far")
    fields = {k: getattr(defaults, k) for k in TINY_SIZES if hasattr(defaults, k)}
    if "layer_types" in defaults.to_dict():
        fields["layer_types"] = defaults.layer_types
    sizes = tiny_sizes(fields)
    try:
        config = config_cls(**sizes)
    except (TypeError, ValueError) as e:
        raise NoTinyCheckpoint(f"{config_cls.__name__} refuses the tiny sizes {sizes}: {e}") from None
    config.architectures = [architecture]
    config.dtype = "float32"
    return config


def make_tiny_checkpoint(architecture: str, path: Path, model_cls: type | None = None) -> Path:
    """Write the tiny checkpoint of ``architecture`` to ``path`` (config.json + model.safetensors)."""
    import torch

    config = tiny_config(architecture, model_cls)
    torch.manual_seed(SEED)
    try:
        model = hf_class(architecture, model_cls)(config).to(torch.float32)
    except Exception as e:  # noqa: BLE001 - transformers' own limits, not the vLLM model's fault
        raise NoTinyCheckpoint(f"transformers cannot build a tiny {architecture}: {type(e).__name__}: {e}") from None
    _save_without_progress_bar(model, path)
    config_path = Path(path) / "config.json"
    saved = json.loads(config_path.read_text())
    saved["architectures"] = [architecture]  # save_pretrained writes the transformers class's name
    config_path.write_text(json.dumps(saved, indent=2))
    return path


def _save_without_progress_bar(model: Any, path: Path) -> None:
    """``model.save_pretrained`` with transformers' progress bar off. Its tqdm bar creates tqdm's class-wide
    ``multiprocessing.RLock`` from multiprocessing's default context, which in a check child (a forkserver child)
    is a named semaphore registered with the resource tracker; the child leaves by ``os._exit``, so nothing
    unlinks it and every run that made a checkpoint ended with the tracker's "leaked semaphore objects"."""
    from transformers.utils import logging as hf_logging

    enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        model.save_pretrained(path, safe_serialization=True)
    finally:
        if enabled:
            hf_logging.enable_progress_bar()


def tiny_checkpoint(architecture: str, workdir: str, model_cls: type | None = None) -> Path:
    """The architecture's tiny checkpoint under ``workdir``, made once (atomically, so xdist workers share it)."""
    path = Path(workdir) / "vllm-checkpoints" / architecture
    if (path / "config.json").exists():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=path.parent, prefix=f".{architecture}-"))
    try:
        make_tiny_checkpoint(architecture, tmp, model_cls)
        os.replace(tmp, path)
    except OSError:  # another process of this session made it first
        if not (path / "config.json").exists():
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return path
