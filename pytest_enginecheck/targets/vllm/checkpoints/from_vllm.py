"""Tiny checkpoints written from vLLM's side, for the architectures transformers has no model class for.

The config: the class vLLM itself parses the checkpoint's ``model_type`` with (``vllm_config_class``: vLLM's
config registry, else transformers' ``CONFIG_MAPPING``), shrunk by the text decoders' rules
(``checkpoints.tiny_text_config``) plus VLLM_CONFIG_SIZES, the size fields of vLLM's own configs.

The weights: vLLM's model class is built at TP=1 on the CPU under vLLM's own config objects (``EngineArgs`` of the
config-only checkpoint), its parameters are split back into checkpoint names (``checkpoint_shapes``: a packed linear
layer into its ``packed_modules_mapping`` shards, a fused MoE layer into one tensor per expert and projection by the
model's expert mapping, vLLM's ``hf_to_vllm_mapper`` undone), and random values under ``checkpoints.SEED`` go to
model.safetensors. Before the checkpoint is returned, the round trip is proven (``prove_round_trip``): the model's
own ``load_weights`` loads every parameter wholly, and every written tensor changes a parameter. What fails there is
the checker's limit: NoTinyCheckpoint naming the tensors or parameters, never a failure of the model.

All of it runs in a fork (``engine_ref.isolation.run_isolated``): building vLLM's model initialises torch.distributed,
which the check child, which forks vLLM's engine ranks next, must not have done.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pytest_enginecheck.targets.vllm.checkpoints.config_dtype import set_float32
from pytest_enginecheck.targets.vllm.checkpoints.declared import declared_config
from pytest_enginecheck.targets.vllm.checkpoints.hub_layout import hub_fields
from pytest_enginecheck.targets.vllm.checkpoints.shrink import (
    VLLM_CONFIG_SIZES,
    NoTinyCheckpoint,
    tiny_text_config,
)
from pytest_enginecheck.targets.vllm.checkpoints.vllm_build import FORK_TIMEOUT_S, import_in_parent, vllm_class
from pytest_enginecheck.targets.vllm.checkpoints.vllm_configs import (
    HUB_FIELDS,
    RemoteConfigOnly,
    architecture_to_model_type,
    vllm_config_class,
)
from pytest_enginecheck.targets.vllm.checkpoints.weight_layout import WEIGHTS_FILE, write_and_prove


def tiny_vllm_config(architecture: str, model_cls: type) -> Any:
    """The config vLLM parses ``architecture``'s checkpoint with, shrunk (tiny_text_config with VLLM_CONFIG_SIZES).
    A multimodal class's composite config: its text decoder and encoders shrunk by vllm_multimodal.py."""
    if getattr(model_cls, "supports_multimodal", False):
        from pytest_enginecheck.targets.vllm.checkpoints.multimodal import tiny_multimodal_config

        return tiny_multimodal_config(architecture, model_cls)
    model_type, config_cls = vllm_config_class(architecture, model_cls)  # RemoteConfigOnly: remote_config.py
    try:
        defaults = config_cls()
    except Exception as e:  # noqa: BLE001 - the config needs arguments the checker cannot know
        raise NoTinyCheckpoint(f"{config_cls.__name__}() (vLLM's config of model_type {model_type!r}) cannot be built "
                               f"with its defaults: {type(e).__name__}: {e}") from None
    config = tiny_text_config(config_cls, defaults, VLLM_CONFIG_SIZES)
    for field, value in HUB_FIELDS.get(model_type, {}).items():
        setattr(config, field, value)
    if not hasattr(config, "tie_word_embeddings"):  # transformers 5's base config has none; vLLM's models read it
        config.tie_word_embeddings = False
    for field, value in declared_config(architecture, model_cls).items():  # the author's, over the shrink rules
        setattr(config, field, value)
    config.architectures = [architecture]
    set_float32(config)  # issue 34: the field older transformers reads and saves (config_dtype.py)
    return config


def make_vllm_checkpoint(architecture: str, path: Path, model_cls: type | None = None, config: Any = None,
                         reason: str = "") -> Path:
    """Write ``architecture``'s tiny checkpoint to ``path`` with weights from vLLM's model (the module docstring):
    config.json from ``config`` (default: ``tiny_vllm_config``), model.safetensors, round trip proven. ``reason``:
    why transformers cannot make it, told first where no config class is found either. Where only remote code
    defines the config, the checker's remote configs (remote_config.py) in turn; the first one's reason where none
    makes a checkpoint (``reason`` told first only where no config is found)."""
    from pytest_enginecheck.targets.vllm.checkpoints import remote_config

    if config is not None:
        return _write(architecture, path, config)
    try:
        model_cls = model_cls or vllm_class(architecture)
        try:
            configs: list[tuple[Any, Any]] = [(tiny_vllm_config(architecture, model_cls), None)]
        except RemoteConfigOnly:  # the config the hub checkpoint's own code defines: the checker writes one
            configs = [(remote.config(), remote) for remote in
                       remote_config.tiny_remote_configs(architecture, model_cls, architecture_to_model_type())]
    except NoTinyCheckpoint as e:
        raise NoTinyCheckpoint(f"{reason}; {e}" if reason else str(e)) from None
    first: NoTinyCheckpoint | None = None
    for tiny, remote in configs:  # a remote config: the model's full path first, then its path without "off" fields
        try:
            return _write(architecture, path, tiny, remote)
        except NoTinyCheckpoint as e:
            first = first or e
    assert first is not None
    raise first


def _write(architecture: str, path: Path, config: Any, remote: Any = None) -> Path:
    """Write config.json of ``config`` (with ``remote``'s configuration_enginecheck.py and auto_map, a
    ``remote_config.RemoteConfig``), then the weights and the round trip in a fork; a half-made checkpoint is
    removed before NoTinyCheckpoint goes on."""
    from engine_ref.isolation import run_isolated
    from pytest_enginecheck.targets.vllm.checkpoints import remote_config, tokenizer

    import_in_parent()
    saved = json.loads(config.to_json_string(use_diff=False))
    saved.update(architectures=[architecture], dtype="float32")
    saved.update({k: v for k, v in hub_fields(saved).items() if k not in saved})
    path.mkdir(parents=True, exist_ok=True)
    if remote is not None:
        remote.write(path)
        saved["auto_map"] = dict(remote_config.AUTO_MAP)
    (path / "config.json").write_text(json.dumps(saved, indent=2))
    tokenizer.write_tokenizer_if_needed(architecture, path, None)  # a model whose __init__ reads it (tokenizer.py)
    try:
        run_isolated(write_and_prove, str(path), timeout=FORK_TIMEOUT_S, name=f"vllm-weights:{architecture}")
    except NoTinyCheckpoint:
        for name in ("config.json", WEIGHTS_FILE, remote_config.MODULE_FILE):  # a half-made checkpoint is none
            (path / name).unlink(missing_ok=True)
        raise
    return path
