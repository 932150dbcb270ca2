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

import contextlib
import json
import math
import re
from collections.abc import Collection, Iterator, Mapping
from pathlib import Path
from typing import Any

from pytest_enginecheck.targets.vllm.checkpoints import (
    MAX_TINY_PARAMETERS,
    SEED,
    NoTinyCheckpoint,
    hub_fields,
    tiny_text_config,
)

# Size fields of vLLM's own configs (vllm.transformers_utils.configs), where the config has them: ChatGLM's and
# Step3's names for what TINY_SIZES calls intermediate_size, vocab_size, head_dim, max_position_embeddings, the expert
# counts and the key/value head groups.
VLLM_CONFIG_SIZES: dict[str, Any] = {
    "ffn_hidden_size": 128, "padded_vocab_size": 256, "kv_channels": 32, "seq_length": 256, "max_seq_len": 256,
    "max_position_embedding": 256, "moe_num_experts": 4, "moe_top_k": 2, "share_expert_dim": 64, "share_q_dim": 64,
    "num_attention_groups": 2,
}
# Fields of the hub checkpoints that vLLM's model reads and its config class does not default (ChatGLM's
# ``original_rope``) or defaults in another form (Step3's MoE layers, a comma-separated string on the hub: the tiny
# model's second layer), by model_type.
HUB_FIELDS: dict[str, dict[str, Any]] = {"chatglm": {"original_rope": True}, "step3_text": {"moe_layers_enum": "1"}}
CONFIG_REGISTRY = (("vllm.transformers_utils.config", "_CONFIG_REGISTRY"),)
ARCHITECTURE_TO_MODEL_TYPE = (("vllm.transformers_utils.config", "_ARCHITECTURE_TO_MODEL_TYPE"),)
ENGINE_ARGS_CLASS = (("vllm.engine.arg_utils", "EngineArgs"), ("vllm", "EngineArgs"))
CURRENT_CONFIG = (("vllm.config", "set_current_vllm_config"),)
INIT_DISTRIBUTED = (("vllm.distributed.parallel_state", "init_distributed_environment"),)
INIT_MODEL_PARALLEL = (("vllm.distributed.parallel_state", "ensure_model_parallel_initialized"),)
# The layer holding a fused MoE's expert weights (w13_weight, w2_weight): RoutedExperts since vLLM split it out of
# FusedMoE, FusedMoE before.
FUSED_MOE = (("vllm.model_executor.layers.fused_moe.routed_experts", "RoutedExperts"),
             ("vllm.model_executor.layers.fused_moe", "FusedMoE"))
# vLLM's usual fused projections and their checkpoint shards, where the model's packed_modules_mapping names none.
DEFAULT_PACKED = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}
WEIGHT_STD = 0.02  # transformers' usual initializer_range
WEIGHTS_FILE = "model.safetensors"
FORK_TIMEOUT_S = 240.0
EXPERT_LAYOUTS = (False, True)  # a fused MoE's checkpoint tensors: per expert, then stacked (checkpoint_shapes)


class NotRoundTripped(NoTinyCheckpoint):
    """The written checkpoint does not round-trip through ``load_weights``; ``unloaded``: the parameters it left
    not (wholly) loaded; ``unconsumed``: the tensors that changed no parameter."""

    def __init__(self, unloaded: list[str], message: str, unconsumed: list[str] | None = None) -> None:
        super().__init__(message)
        self.unloaded = unloaded
        self.unconsumed = unconsumed or []

    def __reduce__(self) -> tuple[Any, ...]:
        """Pickled with its fields (it leaves the fork that makes the checkpoint)."""
        return type(self), (self.unloaded, str(self), self.unconsumed)


class RemoteConfigOnly(NoTinyCheckpoint):
    """Neither transformers nor vLLM's config registry has the architecture's config class: only the hub
    checkpoint's remote code defines it (remote_config.py writes one)."""


def _config_registry() -> Mapping[str, Any]:
    from pytest_enginecheck.targets.vllm.probe import find

    registry: Mapping[str, Any] = find(CONFIG_REGISTRY, "the tiny checkpoint finds vLLM's own config classes in")
    return registry


def _resolve(model_type: str) -> type | None:
    """The class vLLM parses a config.json of ``model_type`` with: its config registry's first, then transformers'."""
    import transformers

    if model_type in _config_registry():
        found: type = _config_registry()[model_type]
        return found
    mapping = transformers.CONFIG_MAPPING  # transformers' lazy mapping: its get() does not look the type up
    return mapping[model_type] if model_type in mapping else None  # noqa: SIM401


def _model_modules(model_cls: type) -> list[Any]:
    """The modules of the model class and of its nn.Module bases (where vLLM's model code imports its config)."""
    import inspect

    import torch

    modules = [inspect.getmodule(c) for c in model_cls.__mro__
               if issubclass(c, torch.nn.Module) and not c.__module__.startswith("torch.")]
    return list(dict.fromkeys(m for m in modules if m is not None))


def _architecture_to_model_type() -> Mapping[str, str]:
    """vLLM's map of the architectures whose checkpoints name no model_type ({} where this vLLM has none)."""
    from pytest_enginecheck.targets.vllm.probe import VllmUnavailable, find

    try:
        found: Mapping[str, str] = find(ARCHITECTURE_TO_MODEL_TYPE, "vLLM maps architectures to model types")
    except VllmUnavailable:
        return {}
    return found


def vllm_config_class(architecture: str, model_cls: type) -> tuple[str, type]:
    """The ``model_type`` the checkpoint's config.json names for ``architecture`` and the config class vLLM parses it
    with: vLLM's own architecture -> model type map, else the model module's name where vLLM's config registry has it
    (``step3p5``), else the one model type of the config classes the model's modules import (ChatGLM's
    ``ChatGLMConfig``). NoTinyCheckpoint where none is found (a config that only remote code defines)."""
    by_architecture = _architecture_to_model_type()
    modules = _model_modules(model_cls)
    candidates = [by_architecture.get(architecture)]
    candidates += [name for m in modules if (name := m.__name__.rsplit(".", 1)[-1]) in _config_registry()]
    for model_type in candidates:
        if model_type and (found := _resolve(model_type)) is not None:
            return model_type, found
    from transformers import PretrainedConfig

    imported = {getattr(o, "model_type", "") for m in modules for o in vars(m).values()
                if isinstance(o, type) and issubclass(o, PretrainedConfig) and o is not PretrainedConfig}
    resolved = sorted(t for t in imported if t and _resolve(t) is not None)
    missing: list[str] = []
    if len(resolved) == 1:
        model_type = resolved[0]
        config_cls = _resolve(model_type)
        assert config_cls is not None
        missing = _unread(model_cls, config_cls)
        if not missing:
            return model_type, config_cls
    where = ", ".join(m.__name__ for m in modules)
    if missing:  # DeciLM's modules import LlamaConfig, and read block_configs, which only its remote config has
        raise RemoteConfigOnly(f"the config class {resolved[0]!r} that {architecture}'s modules import has no "
                               f"{', '.join(missing)}, which the model reads: its config comes from remote code")
    raise RemoteConfigOnly(f"neither transformers nor vLLM's config registry has a config class for {architecture} "
                           f"(its modules {where} import "
                           f"{'the config classes of ' + ', '.join(resolved) if resolved else 'none vLLM resolves'}): "
                           f"its config comes from remote code")


def _unread(model_cls: type, config_cls: type) -> list[str]:
    """The config fields vLLM's ``model_cls`` reads without a default (remote_config.model_config_reads) that the
    default ``config_cls`` has not."""
    from pytest_enginecheck.targets.vllm.remote_config import model_config_reads

    try:
        defaults = config_cls()
    except Exception:  # noqa: BLE001 - judged where the tiny config is built (tiny_vllm_config)
        return []
    return sorted(field for field in model_config_reads(model_cls).required if not hasattr(defaults, field))


def tiny_vllm_config(architecture: str, model_cls: type) -> Any:
    """The config vLLM parses ``architecture``'s checkpoint with, shrunk (tiny_text_config with VLLM_CONFIG_SIZES).
    A multimodal class's composite config: its text decoder and encoders shrunk by vllm_multimodal.py."""
    if getattr(model_cls, "supports_multimodal", False):
        from pytest_enginecheck.targets.vllm.vllm_multimodal import tiny_multimodal_config

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
    config.architectures = [architecture]
    config.dtype = "float32"
    return config


def make_vllm_checkpoint(architecture: str, path: Path, model_cls: type | None = None, config: Any = None,
                         reason: str = "") -> Path:
    """Write ``architecture``'s tiny checkpoint to ``path`` with weights from vLLM's model (the module docstring):
    config.json from ``config`` (default: ``tiny_vllm_config``), model.safetensors, round trip proven. ``reason``:
    why transformers cannot make it, told first where no config class is found either. Where only remote code
    defines the config, the checker's remote configs (remote_config.py) in turn; the first one's reason where none
    makes a checkpoint (``reason`` told first only where no config is found)."""
    from pytest_enginecheck.targets.vllm import remote_config

    if config is not None:
        return _write(architecture, path, config)
    try:
        model_cls = model_cls or _model_class(architecture)
        try:
            configs: list[tuple[Any, Any]] = [(tiny_vllm_config(architecture, model_cls), None)]
        except RemoteConfigOnly:  # the config the hub checkpoint's own code defines: the checker writes one
            configs = [(remote.config(), remote) for remote in
                       remote_config.tiny_remote_configs(architecture, model_cls, _architecture_to_model_type())]
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
    from pytest_enginecheck.targets.vllm import remote_config, tokenizer

    _import_in_parent()
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
        run_isolated(_write_and_prove, str(path), timeout=FORK_TIMEOUT_S, name=f"vllm-weights:{architecture}")
    except NoTinyCheckpoint:
        for name in ("config.json", WEIGHTS_FILE, remote_config.MODULE_FILE):  # a half-made checkpoint is none
            (path / name).unlink(missing_ok=True)
        raise
    return path


def _import_in_parent() -> None:
    """Import here, once, what the fork builds vLLM's model with (``probe.find`` caches nothing, the modules stay
    imported): otherwise every fork imports vLLM's engine modules again (seconds each)."""
    from pytest_enginecheck.targets.vllm.probe import engine_api, find, model_initializer

    engine_api()
    model_initializer()
    for candidates in (ENGINE_ARGS_CLASS, CURRENT_CONFIG, INIT_DISTRIBUTED, INIT_MODEL_PARALLEL, FUSED_MOE):
        find(candidates, "the tiny checkpoint builds vLLM's model with")


def prove_round_trip(path: Path) -> None:
    """Load ``path``'s model.safetensors into vLLM's TP=1 model of its config.json (in a fork); NoTinyCheckpoint
    naming what the model's ``load_weights`` did not consume or did not load."""
    from engine_ref.isolation import run_isolated

    _import_in_parent()
    run_isolated(_prove_in_fork, str(path), timeout=FORK_TIMEOUT_S, name="vllm-weights:prove")


def _model_class(architecture: str) -> type:
    from pytest_enginecheck.targets.vllm import registry

    entry = next((e for e in registry.list_architectures() if e.architecture == architecture), None)
    if entry is None:
        raise NoTinyCheckpoint(f"{architecture} is not in vLLM's registry")
    imported = registry.import_model_class(entry)
    if imported.model_cls is None:
        raise NoTinyCheckpoint(f"vLLM's class for {architecture} cannot be imported: {imported.error}")
    return imported.model_cls


def _write_and_prove(path: str) -> None:
    """In a fork: build vLLM's model, write its checkpoint tensors, prove the round trip; a fused MoE's experts one
    tensor per expert and projection first, then stacked (EXPERT_LAYOUTS), the first layout's reason where neither
    round-trips."""
    with _vllm_model(path) as build:
        model = build()
        first: NoTinyCheckpoint | None = None
        for stacked in EXPERT_LAYOUTS if _has_fused_moe(model) else EXPERT_LAYOUTS[:1]:
            try:
                _write_layout(model, build.architecture, Path(path), stacked)
                return
            except NoTinyCheckpoint as e:
                first = first or e
        assert first is not None
        raise first


def _write_layout(model: Any, architecture: str, path: Path, stacked_experts: bool) -> None:
    """Write ``model``'s checkpoint tensors to ``path`` (``checkpoint_shapes``) and prove the round trip; where it
    fails, write them again as the model's loader takes them and prove it again: a packed layer it did not fill from
    the shards whole, a tensor it did not consume under the name its loader maps to the parameter
    (``_consumed_name``)."""
    try:
        shapes = checkpoint_shapes(model, stacked_experts=stacked_experts)
    except Exception as e:  # noqa: BLE001 - a layer the splitting rules do not know: the checker's limit
        raise NoTinyCheckpoint(f"the checker cannot split the parameters of vLLM's {architecture} into "
                               f"checkpoint tensors: {type(e).__name__}: {e}") from None
    _save_random(shapes, path)
    try:
        _prove(model, path)
    except NotRoundTripped as split:
        # a packed layer its loader did not fill from the shards: the hub checkpoint holds it fused (Moondream's
        # ``qkv``), so it is written whole, and the round trip is proven again
        whole = {name.rpartition(".")[0] for name in split.unloaded} & set(_packed_layers(model))
        renamed = {name: found for name in split.unconsumed if (found := _consumed_name(model, name, shapes[name]))}
        if not whole and not renamed:
            raise
        _save_random(checkpoint_shapes(model, whole, stacked_experts), path, renamed)
        _prove(model, path)


def _save_random(shapes: Mapping[str, tuple[tuple[int, ...], Any, bool]], path: Path,
                 renamed: Mapping[str, str] | None = None) -> None:
    """Write random tensors of ``shapes`` (``checkpoint_shapes``) under ``checkpoints.SEED`` to ``path``, those of
    ``renamed`` under its name for them."""
    import torch
    from safetensors.torch import save_file

    torch.manual_seed(SEED)
    names = renamed or {}
    tensors = {names.get(name, name): _random(shape, dtype, norm)
               for name, (shape, dtype, norm) in sorted(shapes.items())}
    save_file(tensors, str(path / WEIGHTS_FILE))


def _prove_in_fork(path: str) -> None:
    with _vllm_model(path) as build:
        _prove(build(), Path(path))


class _Builder:
    """Builds vLLM's TP=1 model of a config-only checkpoint on the CPU (after counting it on the meta device)."""

    def __init__(self, vllm_config: Any, architecture: str) -> None:
        self.vllm_config = vllm_config
        self.architecture = architecture

    def __call__(self) -> Any:
        from pytest_enginecheck.targets.vllm.memory import _built_model
        from pytest_enginecheck.targets.vllm.probe import model_initializer

        try:
            try:
                meta = _built_model(model_initializer(), self.vllm_config, "meta")
            except (NotImplementedError, RuntimeError) as e:  # a constructor reading a tensor's value (FireRedASR2's
                if "meta tensor" not in str(e):  # positional encoding: torch raises a RuntimeError; memory._meta_model)
                    raise
                meta = None
            if meta is not None:
                _check_size(self.architecture, meta)
            model = _built_model(model_initializer(), self.vllm_config, "cpu")
        except NoTinyCheckpoint:
            raise
        except Exception as e:  # noqa: BLE001 - the tiny config's limit (a field the rules do not know)
            from pytest_enginecheck.targets.vllm.failures import classify
            from pytest_enginecheck.targets.vllm.limits import checker_limit

            limit = checker_limit(classify(e, 0))  # a feature vLLM's CPU backend lacks: no config would build it
            if limit:
                raise NoTinyCheckpoint(f"vLLM's {self.architecture} cannot be built on vLLM's CPU backend: "
                                       f"{limit}") from None
            raise NoTinyCheckpoint(f"vLLM's {self.architecture} cannot be built at TP=1 from the tiny config: "
                                   f"{type(e).__name__}: {e}") from None
        _check_size(self.architecture, model)
        return model


def _check_size(architecture: str, model: Any) -> None:
    params = list(model.named_parameters())
    total = sum(p.numel() for _, p in params)
    if total > MAX_TINY_PARAMETERS:
        name, largest = max(params, key=lambda item: item[1].numel())
        raise NoTinyCheckpoint(f"the tiny config of {architecture} still makes {total / 1e6:.0f}M parameters in vLLM's "
                               f"model (the largest: {name} {tuple(largest.shape)}): a size field the shrink rules "
                               f"do not know")


@contextlib.contextmanager
def _vllm_model(path: str) -> Iterator[_Builder]:
    """vLLM's config objects of the config-only checkpoint at ``path`` (the engine's arguments) current and a TP=1
    process group (gloo) while the block runs, which gets the ``_Builder`` of its model."""
    import os

    from pytest_enginecheck.targets.vllm.engine import ENGINE_ARGS, checkpoint_args
    from pytest_enginecheck.targets.vllm.env import cpu_engine_env
    from pytest_enginecheck.targets.vllm.probe import engine_api, find

    needed = "the tiny checkpoint builds vLLM's model from its config with"
    os.environ.update(cpu_engine_env(1))
    architecture = json.loads((Path(path) / "config.json").read_text())["architectures"][0]
    engine_args = find(ENGINE_ARGS_CLASS, needed)
    try:
        vllm_config = engine_args(model=path, **{**ENGINE_ARGS, **checkpoint_args(path)}).create_engine_config()
    except Exception as e:  # noqa: BLE001 - vLLM refusing the tiny config: the checker's limit
        raise NoTinyCheckpoint(f"vLLM refuses the tiny config of {architecture}: {type(e).__name__}: {e}") from None
    with find(CURRENT_CONFIG, needed)(vllm_config):
        port = engine_api().get_open_port()
        find(INIT_DISTRIBUTED, needed)(world_size=1, rank=0, local_rank=0, backend="gloo",
                                       distributed_init_method=f"tcp://127.0.0.1:{port}")
        find(INIT_MODEL_PARALLEL, needed)(1, 1)
        yield _Builder(vllm_config, architecture)  # the fork ends next: its process group goes with it


def _random(shape: tuple[int, ...], dtype: Any, norm: bool) -> Any:
    """Random values of a checkpoint tensor: a norm's weight around 1, anything else around 0 (WEIGHT_STD)."""
    import torch

    if not dtype.is_floating_point:
        return torch.zeros(shape, dtype=dtype)
    values = torch.randn(shape, dtype=torch.float32) * WEIGHT_STD
    return (values + 1 if norm else values).to(dtype)


def unmapped_name(model: Any, name: str) -> str:
    """The checkpoint name vLLM's ``hf_to_vllm_mapper`` maps to the parameter ``name``: ``name`` itself where the
    mapper leaves it so, else the first inverse of one of its prefix/substring/suffix rules that maps back."""
    mapper = getattr(model, "hf_to_vllm_mapper", None)
    if mapper is None or getattr(mapper, "_map_name", None) is None or mapper._map_name(name) == name:
        return name
    for rules in (mapper.orig_to_new_prefix, mapper.orig_to_new_substr, mapper.orig_to_new_suffix):
        for orig, new in rules.items():
            if new and new in name:
                candidate = name.replace(new, orig, 1)
                if mapper._map_name(candidate) == name:
                    return str(candidate)
    return name


def expert_mapping(model: Any, moe: Any) -> list[tuple[str, str, int, str]]:
    """(parameter part, checkpoint part, expert, shard) of a fused MoE layer: the layer's own ``get_expert_mapping``
    (RoutedExperts knows its checkpoint names), else the model's, else vLLM's for gate_proj/up_proj/down_proj."""
    for owner in (moe, model):
        get = getattr(owner, "get_expert_mapping", None)
        if callable(get):
            mapping: list[tuple[str, str, int, str]] = list(get())
            if mapping:
                return mapping
    return list(moe.make_expert_params_mapping(model, ckpt_gate_proj_name="gate_proj", ckpt_down_proj_name="down_proj",
                                               ckpt_up_proj_name="up_proj", num_experts=moe.global_num_experts))


def _packed_layers(model: Any) -> list[str]:
    """The names of ``model``'s packed linear layers (one shard per ``packed_modules_mapping`` entry)."""
    packed = {**DEFAULT_PACKED, **(getattr(model, "packed_modules_mapping", None) or {})}
    return [name for name, module in model.named_modules()
            if len(packed.get(name.rpartition(".")[2], [])) == len(getattr(module, "output_sizes", None) or []) > 1]


def _has_fused_moe(model: Any) -> bool:
    """Whether ``model`` has a fused MoE layer (FUSED_MOE)."""
    from pytest_enginecheck.targets.vllm.probe import find

    fused_moe = find(FUSED_MOE, "the tiny checkpoint splits fused experts with")
    return any(isinstance(module, fused_moe) for module in model.modules())


def checkpoint_shapes(model: Any, whole: Collection[str] = (), stacked_experts: bool = False
                      ) -> dict[str, tuple[tuple[int, ...], Any, bool]]:
    """The checkpoint tensors vLLM's TP=1 ``model`` loads: name -> (shape, dtype, whether a norm's weight); the
    packed layers named in ``whole`` as one tensor each, not split into their shards. A fused MoE's experts one
    tensor per expert and projection, or with ``stacked_experts`` one per projection, the experts along its first
    dimension (Step3Text's ``moe.gate_proj.weight``)."""
    from pytest_enginecheck.targets.vllm.probe import find

    fused_moe = find(FUSED_MOE, "the tiny checkpoint splits fused experts with")
    packed = {**DEFAULT_PACKED, **(getattr(model, "packed_modules_mapping", None) or {})}
    stacked = stacked_shards(model)
    shapes: dict[str, tuple[tuple[int, ...], Any, bool]] = {}
    for name, param in model.named_parameters():
        owner, _, attr = name.rpartition(".")
        module = model.get_submodule(owner)
        norm = "norm" in type(module).__name__.lower() and param.dim() == 1
        if isinstance(module, fused_moe):
            for ckpt_name, shape in _expert_shapes(model, module, name, attr, param, stacked_experts):
                shapes[unmapped_name(model, ckpt_name)] = (shape, param.dtype, False)
            continue
        leaf = owner.rpartition(".")[2]
        sizes = list(getattr(module, "output_sizes", None) or [])
        shards = stacked[leaf] if len(stacked.get(leaf, [])) == len(sizes) > 1 else packed.get(leaf, [leaf])
        if len(shards) > 1 and len(shards) == len(sizes) and owner not in whole:
            dim = getattr(param, "output_dim", 0)
            for shard, size in zip(shards, sizes, strict=True):
                shape = tuple(size if d == dim else n for d, n in enumerate(param.shape))
                shapes[unmapped_name(model, f"{owner[: -len(leaf)]}{shard}.{attr}")] = (shape, param.dtype, False)
            continue
        shapes[unmapped_name(model, name)] = (tuple(param.shape), param.dtype, norm)
    return shapes


def stacked_shards(model: Any) -> dict[str, list[str]]:
    """The checkpoint shards of packed layers that a ``hf_to_vllm_mapper`` of ``model`` or of one of its modules
    stacks (``orig_to_new_stacked``: TeleChat2Model's ``.query`` -> ``(.qkv_proj, "q")``), by packed layer, in shard
    order (q, k, v; 0, 1): the hub's names, where the model's packed_modules_mapping names vLLM's usual ones. Only
    rules of one module name to one (no path), and only layers whose every shard one name gives."""
    order = {"q": 0, "k": 1, "v": 2}
    stacked: dict[str, dict[int, set[str]]] = {}
    for module in model.modules():
        rules = getattr(getattr(module, "hf_to_vllm_mapper", None), "orig_to_new_stacked", None) or {}
        for orig, (new, shard) in rules.items():
            one_name = "." not in orig.strip(".") and "." not in new.strip(".")
            if one_name and (not isinstance(shard, str) or shard in order):
                index = order[shard] if isinstance(shard, str) else int(shard)
                stacked.setdefault(new.strip("."), {}).setdefault(index, set()).add(orig.strip("."))
    return {layer: [next(iter(shards[i])) for i in sorted(shards)] for layer, shards in stacked.items()
            if all(len(names) == 1 for names in shards.values())}


def _expert_shapes(model: Any, moe: Any, name: str, attr: str, param: Any, stacked: bool = False
                   ) -> Iterator[tuple[str, tuple[int, ...]]]:
    """The per-expert checkpoint tensors of a fused MoE parameter ``name`` (``w13_weight``: each expert's gate and up
    projections, halves of its second dimension; ``w2_weight``: each expert's down projection), named as the
    mapping names them below the MoE block (the module above ``.experts.``). ``stacked``: one tensor per projection
    of all the experts, named without the expert (``experts.0.gate_proj.`` -> ``gate_proj.``)."""
    block = name[: name.rfind(".experts.") + 1]
    seen: set[str] = set()
    for param_part, weight_part, _expert, shard in expert_mapping(model, moe):
        token = param_part.rpartition(".")[2]  # "w13_"
        if not attr.startswith(token):
            continue
        per_expert = tuple(param.shape[1:])
        if shard in ("w1", "w3") and per_expert and attr.startswith("w13_"):
            per_expert = (per_expert[0] // 2, *per_expert[1:])
        if stacked:
            weight_part = re.sub(r"(^|\.)experts\.\d+\.", r"\1", weight_part)
            per_expert = (param.shape[0], *per_expert)
        if (weight_part.startswith("experts.") or stacked) and block:
            ckpt_name = f"{block}{weight_part}{attr[len(token):]}"
        else:
            ckpt_name = name.replace(param_part, weight_part, 1)
        if ckpt_name not in seen:
            seen.add(ckpt_name)
            yield ckpt_name, per_expert


def _unchanged(params: Mapping[str, Any], before: Mapping[str, Any]) -> bool:
    """Whether every parameter of ``params`` equals its copy in ``before``, a NaN (a parameter the round trip left
    unloaded) equal to a NaN."""
    import torch

    return all(torch.equal(torch.nan_to_num(p, nan=math.inf), torch.nan_to_num(before[n], nan=math.inf))
               for n, p in params.items())


def _consumed_name(model: Any, name: str, shape: tuple[tuple[int, ...], Any, bool]) -> str | None:
    """The name, one module shorter than ``name``, under which ``load_weights`` takes a tensor of ``shape``
    (IQuestLoopCoder's ``gate_projections.0.weight``, which its loader maps to the parameter
    ``gate_projections.0.gate_proj.weight``): the first that changes a parameter, None where none does."""
    import torch

    params = dict(model.named_parameters())
    parts = name.split(".")
    for i in range(len(parts) - 2, 0, -1):  # never the tensor's own attribute, never the top module, never an index
        if parts[i].isdigit():
            continue
        candidate = ".".join(parts[:i] + parts[i + 1:])
        tensor = _random(*shape) - 1  # other values than any parameter holds
        before = {n: p.detach().clone() for n, p in params.items()}
        try:
            with torch.no_grad():
                model.load_weights(iter([(candidate, tensor)]))
        except Exception:  # noqa: BLE001 - a name the loader has no parameter for: not this one
            continue
        if not _unchanged(params, before):
            return candidate
    return None


def _prove(model: Any, path: Path) -> None:
    """The round trip: ``load_weights`` of every tensor of ``path``'s model.safetensors into ``model`` (every
    parameter NaN before) loads every parameter wholly, and each tensor, loaded again alone with other values,
    changes a parameter. NoTinyCheckpoint naming what was not loaded or not consumed."""
    import torch
    from safetensors.torch import load_file

    tensors = load_file(str(path / WEIGHTS_FILE))
    params = dict(model.named_parameters())
    with torch.no_grad():
        for p in params.values():
            if p.dtype.is_floating_point:
                p.fill_(math.nan)
        try:
            loaded = model.load_weights(iter(sorted(tensors.items())))
        except Exception as e:  # noqa: BLE001 - the checkpoint the checker wrote is wrong, not the model
            raise NoTinyCheckpoint(f"vLLM's load_weights refuses the tiny checkpoint the checker wrote from its "
                                   f"parameters: {type(e).__name__}: {e}") from None
        unloaded = sorted(n for n, p in params.items() if (loaded is not None and n not in loaded)
                          or (p.dtype.is_floating_point and bool(torch.isnan(p).any())))
        before = {n: p.detach().clone() for n, p in params.items()}
        unconsumed = []
        for name, tensor in sorted(tensors.items()):
            if not tensor.dtype.is_floating_point:
                continue
            try:
                model.load_weights(iter([(name, -tensor - 1)]))  # other values (-t - 1 equals t only at -0.5)
                if _unchanged(params, before):
                    unconsumed.append(name)
                model.load_weights(iter([(name, tensor)]))
            except Exception as e:  # noqa: BLE001 - a loader that takes a tensor only beside others
                raise NoTinyCheckpoint(f"vLLM's load_weights refuses the tiny checkpoint's {name} loaded alone, so "
                                       f"the checker cannot tell it was consumed: {type(e).__name__}: {e}") from None
    if unloaded or unconsumed:
        raise NotRoundTripped(
            unloaded, "the tiny checkpoint written from vLLM's parameters does not round-trip through load_weights: "
            + (f"parameters not (wholly) loaded: {', '.join(unloaded)}" if unloaded else "")
            + ("; " if unloaded and unconsumed else "")
            + (f"tensors written but not consumed: {', '.join(unconsumed)}" if unconsumed else ""), unconsumed)
