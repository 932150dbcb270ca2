"""What the installed vLLM offers, found by probing its modules (never by its version number).

Each probe returns the object vLLM itself uses, or says plainly what it could not find, so a newer
or older vLLM degrades to a clear skip instead of an AttributeError deep inside a check.
"""

from __future__ import annotations

import functools
import importlib
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

REGISTRY_MODULE = "vllm.model_executor.models.registry"
# vLLM's in-tree lists of architectures (names in the registry module), by the kind of model they hold.
MODEL_KINDS = {"_TEXT_GENERATION_MODELS": "text generation", "_MULTIMODAL_MODELS": "multimodal",
               "_EMBEDDING_MODELS": "embedding", "_LATE_INTERACTION_MODELS": "late-interaction",
               "_REWARD_MODELS": "reward", "_TOKEN_CLASSIFICATION_MODELS": "token classification",
               "_SEQUENCE_CLASSIFICATION_MODELS": "sequence classification",
               "_SPECULATIVE_DECODING_MODELS": "speculative-decoding draft",
               # what vLLM's Transformers backend runs: text generation, multimodal, embedding and classification
               # models in the same lists, so vLLM's ModelInfo says which each one is
               "_TRANSFORMERS_SUPPORTED_MODELS": "transformers backend",
               "_TRANSFORMERS_BACKEND_MODELS": "transformers backend"}
GENERATING_KINDS = ("text generation", "multimodal")
MIXED_KINDS = ("transformers backend",)  # lists of several kinds: decided by the ModelInfo, like an unlisted one


class VllmUnavailable(Exception):
    """vLLM (or the part of its API a check needs) is not installed; the message says what is missing."""


@dataclass(frozen=True)
class VllmApi:
    """The pieces of the installed vLLM the adapter calls."""

    version: str
    registry_module: ModuleType
    registry: Any  # vLLM's global ModelRegistry
    model_info_from_cls: Callable[[type], Any]  # what vLLM's inspection subprocess runs on the class
    run_in_subprocess: Callable[[Callable[[], Any]], Any] | None  # vLLM's own fresh-interpreter path
    subprocess_command: tuple[str, ...]
    load_general_plugins: Callable[[], Any]
    plugins_group: str
    model_kinds: dict[str, str]  # in-tree architecture -> the kind vLLM's registry lists it as (MODEL_KINDS)

    def cpu_backend(self) -> str | None:
        """None when vLLM can start its engine on CPU here; otherwise the reason it cannot."""
        return cpu_backend_missing()


def _find_model_info_builder(registry_module: ModuleType) -> Callable[[type], Any]:
    """The ``*ModelInfo.from_model_cls`` staticmethod vLLM's inspection builds the ModelInfo with."""
    for name, obj in vars(registry_module).items():
        if inspect.isclass(obj) and name.endswith("ModelInfo") and callable(getattr(obj, "from_model_cls", None)):
            builder: Callable[[type], Any] = getattr(obj, "from_model_cls")  # noqa: B009 - probed, not declared
            return builder
    raise VllmUnavailable(f"{REGISTRY_MODULE} has no *ModelInfo class with from_model_cls; this vLLM builds "
                          f"its ModelInfo some other way, which the adapter does not know yet")


@functools.cache
def probe() -> VllmApi:
    """Import vLLM's registry and plugin loader and find the functions the checks use."""
    try:
        vllm = importlib.import_module("vllm")
        registry_module = importlib.import_module(REGISTRY_MODULE)
        plugins = importlib.import_module("vllm.plugins")
    except ImportError as e:
        from pytest_enginecheck.targets.vllm.window import not_importable

        raise VllmUnavailable(not_importable(str(e))) from None
    registry = getattr(registry_module, "ModelRegistry", None)
    if registry is None or not hasattr(registry, "models"):
        raise VllmUnavailable(f"{REGISTRY_MODULE}.ModelRegistry with a .models mapping is missing")
    loader = getattr(plugins, "load_general_plugins", None)
    if loader is None:
        raise VllmUnavailable("vllm.plugins.load_general_plugins is missing")
    return VllmApi(
        version=str(getattr(vllm, "__version__", "unknown")),
        registry_module=registry_module,
        registry=registry,
        model_info_from_cls=_find_model_info_builder(registry_module),
        run_in_subprocess=getattr(registry_module, "_run_in_subprocess", None),
        subprocess_command=tuple(getattr(registry_module, "_SUBPROCESS_COMMAND", ())),
        load_general_plugins=loader,
        plugins_group=getattr(plugins, "DEFAULT_PLUGINS_GROUP", "vllm.general_plugins"),
        model_kinds={arch: kind for name, kind in reversed(MODEL_KINDS.items())
                     for arch in getattr(registry_module, name, {})},
    )


def vllm_package_dir() -> Path | None:
    """Where the installed ``vllm`` package lives, found without importing it (None: not installed)."""
    from importlib.util import find_spec

    spec = find_spec("vllm")
    return Path(spec.origin).parent if spec is not None and spec.origin else None


def cpu_backend_missing() -> str | None:
    """Why vLLM's engine cannot start on CPU ranks here (what a vLLM user can do about it), or None when it can.

    Asks the installed distribution and its files, without importing vLLM (a usage error about it comes at
    once, and vLLM's platform would pick CUDA on a GPU build): the CPU build ships a CPU worker, and a release older
    than any measured to run the engine checks is refused (``window``), each in words that name the installed release,
    the releases that run them and the fix for what is installed.
    """
    from pytest_enginecheck.targets.vllm import window

    package = vllm_package_dir()
    if package is None:
        return window.engine_refusal(None, "", has_cpu_worker=False)
    distribution, version = window.installed() or ("", "")
    return window.engine_refusal(distribution, version, (package / "v1" / "worker" / "cpu_worker.py").exists())


LINEAR_MODULE = "vllm.model_executor.layers.linear"
EMBEDDING_MODULE = "vllm.model_executor.layers.vocab_parallel_embedding"


@dataclass(frozen=True)
class ShardingApi:
    """vLLM's parallel layers, whose attributes (``output_partition_sizes``, ``num_kv_head_replicas``,
    ``gather_output``, ``reduce_results``, ``input_is_parallel``) say how a module's output is split over the
    ranks; the TP diagnosis hooks vLLM's model through ``LLM.collective_rpc``."""

    column: Any  # ColumnParallelLinear (Merged* and QKV* are subclasses); Any: its instances' attributes type-check
    qkv: Any  # QKVParallelLinear
    row: Any  # RowParallelLinear
    vocab: Any  # VocabParallelEmbedding (ParallelLMHead is a subclass)


@functools.cache
def sharding_api() -> ShardingApi:
    """vLLM's parallel layer classes, and the check that ``LLM.collective_rpc`` exists."""
    try:
        vllm = importlib.import_module("vllm")
        linear = importlib.import_module(LINEAR_MODULE)
        embedding = importlib.import_module(EMBEDDING_MODULE)
    except ImportError as e:
        raise VllmUnavailable(f"vLLM's parallel layers are not importable here ({e})") from None
    wanted = {"ColumnParallelLinear": linear, "QKVParallelLinear": linear, "RowParallelLinear": linear,
              "VocabParallelEmbedding": embedding}
    missing = [f"{module.__name__}.{name}" for name, module in wanted.items() if not hasattr(module, name)]
    if not hasattr(getattr(vllm, "LLM", None), "collective_rpc"):
        missing.append("vllm.LLM.collective_rpc")
    if missing:
        raise VllmUnavailable(f"this vLLM has no {', '.join(missing)}, which the TP diagnosis hooks vLLM's model with")
    return ShardingApi(column=linear.ColumnParallelLinear, qkv=linear.QKVParallelLinear, row=linear.RowParallelLinear,
                       vocab=embedding.VocabParallelEmbedding)


def worker_model(worker: Any) -> Any:
    """The model a vLLM worker runs (``Worker.get_model()``), for a function sent by ``collective_rpc``."""
    get_model = getattr(worker, "get_model", None)
    if get_model is None:
        raise VllmUnavailable(f"vLLM's {type(worker).__name__} has no get_model(); the TP diagnosis cannot hook "
                              f"its model")
    return get_model()


LOGPROB_FIELDS = ("logprobs", "prompt_logprobs")  # SamplingParams' fields the load check asks log-probabilities with


@functools.cache
def logprobs_api() -> type:
    """vLLM's SamplingParams, checked to take ``logprobs`` and ``prompt_logprobs``: the top-k log-probabilities of
    each generated and each prompt token (``CompletionOutput.logprobs``, ``RequestOutput.prompt_logprobs``)."""
    try:
        sampling_params = importlib.import_module("vllm").SamplingParams
    except (ImportError, AttributeError) as e:
        raise VllmUnavailable(f"vllm.SamplingParams is not importable here ({e})") from None
    fields = getattr(sampling_params, "__struct_fields__", None) or tuple(inspect.signature(sampling_params).parameters)
    missing = [f for f in LOGPROB_FIELDS if f not in fields]
    if missing:
        raise VllmUnavailable(f"this vLLM's SamplingParams has no {', '.join(missing)}, which the load check compares "
                              f"log-probabilities with")
    return sampling_params


def find(candidates: tuple[tuple[str, str], ...], needed_for: str) -> Any:
    """The first ``(module, attribute)`` of ``candidates`` the installed vLLM has (where vLLM moved a function between
    releases, newest first); VllmUnavailable naming every place looked in and ``needed_for`` when none has it."""
    tried = []
    for module, attribute in candidates:
        try:
            found = getattr(importlib.import_module(module), attribute)
        except ImportError as e:
            tried.append(f"{module}.{attribute} (the module is not importable: {e})")
        except AttributeError:
            tried.append(f"{module}.{attribute} (no such attribute)")
        else:
            return found
    raise VllmUnavailable(f"this vLLM has no {' nor '.join(tried)}, which {needed_for}")


# Where vLLM keeps get_open_port: vllm.utils.network_utils since vllm.utils was split into modules, vllm.utils before.
OPEN_PORT = (("vllm.utils.network_utils", "get_open_port"), ("vllm.utils", "get_open_port"))
CLEANUP = (("vllm.distributed.parallel_state", "cleanup_dist_env_and_memory"),)
INITIALIZE_MODEL = (("vllm.model_executor.model_loader.utils", "initialize_model"),)


@dataclass(frozen=True)
class EngineApi:
    """What starting vLLM's engine in a check calls (``engine.py``)."""

    llm: Any  # vllm.LLM, with collective_rpc (rank_memory and the TP diagnosis run on every worker through it)
    sampling_params: Any  # vllm.SamplingParams
    get_open_port: Callable[[], int]  # a free port for the ranks' torch.distributed group
    cleanup: Callable[[], Any] | None  # tears down a process's distributed state; None: this vLLM has none to call


@functools.cache
def engine_api() -> EngineApi:
    """vLLM's LLM, SamplingParams, get_open_port and distributed teardown, found where this vLLM keeps them."""
    engine = "the engine checks (load, budget, startup) start vLLM's engine with"
    llm = find((("vllm", "LLM"),), engine)
    if not callable(getattr(llm, "collective_rpc", None)):
        raise VllmUnavailable(f"this vLLM's LLM has no collective_rpc, which {engine}")
    try:
        cleanup = find(CLEANUP, "shutdown tears a rank's distributed state down with")
    except VllmUnavailable:
        cleanup = None  # each rank is a fork that ends after its engine: nothing outlives it
    return EngineApi(llm=llm, sampling_params=find((("vllm", "SamplingParams"),), engine),
                     get_open_port=find(OPEN_PORT, f"{engine} (the ranks' process group port)"), cleanup=cleanup)


@functools.cache
def model_initializer() -> Callable[..., Any]:
    """vLLM's ``initialize_model(vllm_config=..., prefix=...)``: the budget counts a rank's weights on a meta-device
    copy it builds (``memory.py``)."""
    initializer: Callable[..., Any] = find(INITIALIZE_MODEL, "the budget check sizes a rank's weights with")
    return initializer


def allowed_plugins() -> list[str] | None:
    """vLLM's ``VLLM_PLUGINS`` filter as vLLM reads it (``vllm.envs``): the plugin names it loads, None for all."""
    allowed: list[str] | None = find((("vllm.envs", "VLLM_PLUGINS"),), "vLLM filters its general plugins with")
    return allowed
