"""Tiny Hugging Face checkpoints for vLLM architectures, from transformers' own config classes.

The architecture's transformers class gives its config class; the config is built with every size
shrunk (``TINY_SIZES``: head_dim 32, since vLLM's CPU attention rejects 16), the model is built with
random weights under a fixed seed and saved in HF layout with safetensors. An architecture with no
transformers class gets its config class from vLLM and its weights from vLLM's model (vllm_weights.py); one whose
config refuses the tiny sizes, or for which neither way works, raises NoTinyCheckpoint with the reason.
"""

from __future__ import annotations

import inspect
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pytest_enginecheck.targets.vllm.checkpoints.config_dtype import set_float32
from pytest_enginecheck.targets.vllm.checkpoints.declared import CONFIG_ATTRIBUTE, declared_config
from pytest_enginecheck.targets.vllm.checkpoints.hub_layout import (
    add_hub_norms,
    drop_zero_experts,
    hub_fields,
    rename_written,
)
from pytest_enginecheck.targets.vllm.checkpoints.shrink import (
    MAX_TINY_PARAMETERS,
    SEED,
    NoTinyCheckpoint,
    tiny_text_config,
)

# Fields of a sub-config that the hub's checkpoints have and transformers' config class moved elsewhere, while a model
# still reads them there, by (sub-config, field): the value from where the class keeps it. DBRX's attention's
# rope_theta (transformers' DbrxConfig keeps it in rope_parameters; its own modeling_dbrx.py and vLLM's dbrx.py read
# attn_config.rope_theta). The sub-config keeps it as an extra attribute and writes it to config.json.
SUB_CONFIG_HUB_FIELDS: dict[tuple[str, str], Callable[[Any], Any]] = {
    ("attn_config", "rope_theta"): lambda config: (getattr(config, "rope_parameters", None) or {}).get("rope_theta"),
}


def hf_class(architecture: str, model_cls: type | None = None) -> Any:
    """The transformers class for an architecture: its own name, else the nearest base class of the vLLM
    model class that transformers has (an out-of-tree ``MyLlama(LlamaForCausalLM)`` uses Llama's)."""
    import transformers

    names = [architecture, *(base.__name__ for base in (model_cls.__mro__ if model_cls else ()))]
    try:
        found = next((getattr(transformers, n) for n in names if isinstance(getattr(transformers, n, None), type)),
                     None)
    except Exception as e:  # noqa: BLE001 - transformers' lazy import of its modeling module failed here
        raise NoTinyCheckpoint(f"transformers {transformers.__version__} cannot import its class for {architecture!r}: "
                               f"{type(e).__name__}: {e}") from None
    if found is None:
        raise NoTinyCheckpoint(f"transformers {transformers.__version__} has no class {architecture!r} (nor one of its "
                               f"base classes), so there is no config class to shrink")
    return found


def foreign_base(architecture: str, model_cls: type | None, hf: Any) -> str:
    """Why the transformers class ``hf`` of a base class of vLLM's ``model_cls`` cannot make ``architecture``'s
    checkpoint, or "": the config fields that vLLM's classes above that base read without a default (the sources of
    their modules, ``remote_config.config_reads``) and its default config has not (vLLM's TeleChat2ForCausalLM, a
    LlamaForCausalLM, reads its hub config's ``n_head``; TeleFLM's ``use_mup``: their configs are not Llama's)."""
    if model_cls is None or hf.__name__ == architecture:
        return ""
    from pytest_enginecheck.targets.vllm.checkpoints.remote_config import config_reads

    names = [cls.__name__ for cls in model_cls.__mro__]
    base = names.index(hf.__name__) if hf.__name__ in names else len(names)
    # the modules of vLLM's classes above the base, not the base's own (whose reads the base config answers)
    below = {inspect.getmodule(cls) for cls in model_cls.__mro__[base:]}
    above = [module for cls in model_cls.__mro__[:base] if (module := inspect.getmodule(cls)) not in below]
    try:
        defaults = hf.config_class()
        reads = [config_reads(inspect.getsource(m)).required for m in dict.fromkeys(above) if m is not None]
    except Exception:  # noqa: BLE001 - no default config or no source: judged where the checkpoint is built
        return ""
    declared = declared_config(architecture, model_cls)
    missing = sorted(f for f in frozenset().union(*reads) if not hasattr(defaults, f) and f not in declared)
    if not missing:
        return ""
    return (f"vLLM's {architecture} reads the config field{'s' * (len(missing) > 1)} {', '.join(missing)}, which "
            f"{type(defaults).__name__} of its base class {hf.__name__} has not: its checkpoint is not that class's "
            f"(an out-of-tree class gives them in {CONFIG_ATTRIBUTE}, a dict of config.json fields)")


def tiny_config(architecture: str, model_cls: type | None = None) -> Any:
    """The architecture's transformers config with TINY_SIZES applied."""
    hf = hf_class(architecture, model_cls)
    config_cls = getattr(hf, "config_class", None)
    if config_cls is None:
        raise NoTinyCheckpoint(f"transformers.{architecture} declares no config_class")
    try:
        defaults = config_cls()
    except Exception as e:  # noqa: BLE001 - transformers' limit: the config needs arguments the checker cannot know
        raise NoTinyCheckpoint(f"{config_cls.__name__}() cannot be built with its defaults: {type(e).__name__}: {e}"
                               ) from None
    from pytest_enginecheck.targets.vllm.checkpoints import composite

    if composite.is_composite(defaults):  # a multimodal config: its text decoder shrunk by tiny_text_config
        config = composite.tiny_composite_config(config_cls, defaults, tiny_text_config)
    else:
        config = tiny_text_config(config_cls, defaults)
    for (sub, field), value in SUB_CONFIG_HUB_FIELDS.items():
        sub_config = getattr(config, sub, None)
        if sub_config is not None and not hasattr(sub_config, field):
            setattr(sub_config, field, value(config))
    for field, value in declared_config(architecture, model_cls).items():  # the author's, over the shrink rules
        setattr(config, field, value)
    config.architectures = [architecture]
    set_float32(config)  # issue 34: the field older transformers reads and saves (config_dtype.py)
    return config


def make_hf_checkpoint(architecture: str, path: Path, model_cls: type | None = None) -> Path:
    """Write the tiny checkpoint of ``architecture`` to ``path`` (config.json + model.safetensors) with its
    transformers class (``hf_class``)."""
    import torch

    from pytest_enginecheck.targets.vllm.checkpoints import composite, tokenizer

    config = tiny_config(architecture, model_cls)
    set_float32(config, as_torch_dtype=True)  # modeling code may read it as a torch.dtype (Apertus' xIELU); issue 34
    too_large = _too_large(hf_class(architecture, model_cls), config)
    if too_large:
        raise NoTinyCheckpoint(f"the tiny config of {architecture} still makes {too_large}: a size field the shrink "
                               f"rules do not know")
    torch.manual_seed(SEED)
    try:
        model = hf_class(architecture, model_cls)(config).to(torch.float32)
    except Exception as e:  # noqa: BLE001 - transformers' own limits, not the vLLM model's fault
        raise NoTinyCheckpoint(f"transformers cannot build a tiny {architecture}: {type(e).__name__}: {e}") from None
    vary_constant_parameters(model, getattr(config, "initializer_range", None))
    try:
        _save_without_progress_bar(model, path)
        composite.undo_doubled_prefixes(path, model)
        drop_zero_experts(path, config)
        rename_written(path, str(getattr(config, "model_type", "")))
    except Exception as e:  # noqa: BLE001 - transformers' writer refusing the tiny model, not the vLLM model
        raise NoTinyCheckpoint(f"transformers cannot save a tiny {architecture}: {type(e).__name__}: {e}") from None
    config_path = Path(path) / "config.json"
    saved = json.loads(config_path.read_text())
    saved["architectures"] = [architecture]  # save_pretrained writes the transformers class's name
    saved.update({k: v for k, v in hub_fields(saved).items() if k not in saved})
    config_path.write_text(json.dumps(saved, indent=2))
    add_hub_norms(path, saved)
    tokenizer.write_tokenizer_if_needed(architecture, path, model_cls)  # only where vLLM reads one (tokenizer.py)
    return path


def vary_constant_parameters(model: Any, initializer_range: float | None = None) -> list[str]:
    """Give every parameter that transformers' initialisation left constant (biases at 0, norm weights at 1) random
    values under SEED around that constant: N(0, initializer_range) around 0, 10 % of it around any other constant.
    A bias never loaded, zeroed on one rank, or two norms' weights swapped then change the model's output. Scalars
    keep their value (a learned scale initialised to its meaning). Returns the names of the parameters varied."""
    import torch

    std = initializer_range if isinstance(initializer_range, float) and initializer_range > 0 else 0.02
    generator = torch.Generator().manual_seed(SEED)
    varied = []
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.numel() < 2 or not param.is_floating_point():
                continue
            center = param.reshape(-1)[0].item()
            if not bool((param == center).all()):
                continue
            noise = torch.randn(param.shape, generator=generator, dtype=torch.float32)
            param.copy_(center + noise * (0.1 * abs(center) if center else std))
            varied.append(name)
    return varied


def _too_large(hf_cls: type, config: Any) -> str:
    """What makes the model of ``config`` larger than MAX_TINY_PARAMETERS, counted on the meta device before anything
    is allocated (a field the rules left at its full size would otherwise allocate gigabytes); "" when it fits, or
    when the class cannot be built on the meta device (the real build then says what it says)."""
    import torch

    try:
        with torch.device("meta"):
            model = hf_cls(config)
    except Exception:  # noqa: BLE001 - e.g. a constructor reading a tensor's value: judged by the real build
        return ""
    tensors = [*model.named_parameters(), *model.named_buffers()]
    total = sum(t.numel() for _, t in tensors)
    if total <= MAX_TINY_PARAMETERS:
        return ""
    name, largest = max(tensors, key=lambda item: item[1].numel())
    return f"{total / 1e6:.0f}M parameters and buffers (the largest: {name} {tuple(largest.shape)})"


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
