"""vLLM's model of a config-only checkpoint, built in this process under vLLM's own config objects.

``vllm_model(path)`` makes the checkpoint's config objects current with a TP=1 process group (gloo) and gives a
``Builder`` of its model (counted on the meta device first, then built on the CPU); ``built_model`` and
``meta_model`` build it on a device under a forward context of its own (the engine's memory accounting uses them
too). Building initialises torch.distributed: run it in a fork of a process that forks vLLM's ranks later.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from pytest_enginecheck.targets.vllm.checkpoints.shrink import (
    MAX_TINY_PARAMETERS,
    NoTinyCheckpoint,
)

ENGINE_ARGS_CLASS = (("vllm.engine.arg_utils", "EngineArgs"), ("vllm", "EngineArgs"))
CURRENT_CONFIG = (("vllm.config", "set_current_vllm_config"),)
INIT_DISTRIBUTED = (("vllm.distributed.parallel_state", "init_distributed_environment"),)
INIT_MODEL_PARALLEL = (("vllm.distributed.parallel_state", "ensure_model_parallel_initialized"),)
# The layer holding a fused MoE's expert weights (w13_weight, w2_weight): RoutedExperts since vLLM split it out of
# FusedMoE, FusedMoE before.
FUSED_MOE = (("vllm.model_executor.layers.fused_moe.routed_experts", "RoutedExperts"),
             ("vllm.model_executor.layers.fused_moe", "FusedMoE"))
FORK_TIMEOUT_S = 240.0


def import_in_parent() -> None:
    """Import here, once, what the fork builds vLLM's model with (``probe.find`` caches nothing, the modules stay
    imported): otherwise every fork imports vLLM's engine modules again (seconds each)."""
    from pytest_enginecheck.targets.vllm.probe import engine_api, find, model_initializer

    engine_api()
    model_initializer()
    for candidates in (ENGINE_ARGS_CLASS, CURRENT_CONFIG, INIT_DISTRIBUTED, INIT_MODEL_PARALLEL, FUSED_MOE):
        find(candidates, "the tiny checkpoint builds vLLM's model with")


def vllm_class(architecture: str) -> type:
    from pytest_enginecheck.targets.vllm.describe import registry

    entry = next((e for e in registry.list_architectures() if e.architecture == architecture), None)
    if entry is None:
        raise NoTinyCheckpoint(f"{architecture} is not in vLLM's registry")
    imported = registry.import_model_class(entry)
    if imported.model_cls is None:
        raise NoTinyCheckpoint(f"vLLM's class for {architecture} cannot be imported: {imported.error}")
    return imported.model_cls


def meta_model(vllm_config: Any) -> Any:
    """vLLM's model for this rank on the meta device; its layers leave vLLM's forward context as found.

    A constructor that reads a value of a tensor it made (vLLM's XIELU: ``beta.item()``; FireRedASR2's positional
    encoding, where torch raises a RuntimeError) cannot run on the meta device: that copy is built on the CPU instead
    (the same shapes, the tiny checkpoint's few MiB allocated). The rank built the same model on the CPU a moment
    before, so any other error is the model's own."""
    from pytest_enginecheck.targets.vllm.probe import model_initializer

    try:
        return built_model(model_initializer(), vllm_config, "meta")
    except (NotImplementedError, RuntimeError) as e:
        if "meta tensor" not in str(e):
            raise
        return built_model(model_initializer(), vllm_config, "cpu")


def built_model(initialize_model: Any, vllm_config: Any, device: str) -> Any:
    """The model built on ``device`` in the engine's dtype (vLLM's loader builds it under that default dtype, so
    a bfloat16 engine's weights are counted at 2 bytes, not at float32's 4), with a forward context of its own: its
    layers register there, not beside the rank's (a model that names its layers without the prefix it is given, as
    Zamba2's mamba layers, would collide: "Duplicate layer name: 1.mixer")."""
    import torch

    compilation = vllm_config.compilation_config
    context = compilation.static_forward_context
    compilation.static_forward_context = {}
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(vllm_config.model_config.dtype)
    try:
        with torch.device(device):
            return initialize_model(vllm_config=vllm_config, prefix="enginecheck_meta")
    finally:
        torch.set_default_dtype(default_dtype)
        compilation.static_forward_context = context


class Builder:
    """Builds vLLM's TP=1 model of a config-only checkpoint on the CPU (after counting it on the meta device)."""

    def __init__(self, vllm_config: Any, architecture: str) -> None:
        self.vllm_config = vllm_config
        self.architecture = architecture

    def __call__(self) -> Any:
        from pytest_enginecheck.targets.vllm.checkpoints.vllm_build import built_model as built_model
        from pytest_enginecheck.targets.vllm.probe import model_initializer

        try:
            try:
                meta = built_model(model_initializer(), self.vllm_config, "meta")
            except (NotImplementedError, RuntimeError) as e:  # a constructor reading a tensor's value (FireRedASR2's
                if "meta tensor" not in str(e):  # positional encoding: torch raises a RuntimeError; memory._meta_model)
                    raise
                meta = None
            if meta is not None:
                check_size(self.architecture, meta)
            model = built_model(model_initializer(), self.vllm_config, "cpu")
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
        check_size(self.architecture, model)
        return model


def check_size(architecture: str, model: Any) -> None:
    params = list(model.named_parameters())
    total = sum(p.numel() for _, p in params)
    if total > MAX_TINY_PARAMETERS:
        name, largest = max(params, key=lambda item: item[1].numel())
        raise NoTinyCheckpoint(f"the tiny config of {architecture} still makes {total / 1e6:.0f}M parameters in vLLM's "
                               f"model (the largest: {name} {tuple(largest.shape)}): a size field the shrink rules "
                               f"do not know")


@contextlib.contextmanager
def vllm_model(path: str) -> Iterator[Builder]:
    """vLLM's config objects of the config-only checkpoint at ``path`` (the engine's arguments) current and a TP=1
    process group (gloo) while the block runs, which gets the ``Builder`` of its model."""
    import os

    from pytest_enginecheck.targets.vllm.checkpoints.args import checkpoint_args
    from pytest_enginecheck.targets.vllm.env import ENGINE_ARGS, cpu_engine_env
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
        yield Builder(vllm_config, architecture)  # the fork ends next: its process group goes with it
