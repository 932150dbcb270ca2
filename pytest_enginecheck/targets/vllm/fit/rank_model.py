"""vLLM's own model class built as rank r of a TP=N engine would build it, on the meta device, in this process.

vLLM's parallel layers size themselves from vLLM's tensor-parallel group (``get_tensor_model_parallel_world_size``,
``..._rank``, read from ``parallel_state._TP`` while they are built). This process joins a real TP=1 group once
(gloo, world size 1: ``vllm_build.INIT_DISTRIBUTED``); ``rank_view`` then stands a copy of vLLM's own
``GroupCoordinator`` in for the TP group (and the world and expert groups), answering world size N and rank r, for
as long as the model is built. Nothing communicates while a model is built on the meta device, so no peer is
needed: the shapes are vLLM's own for that rank (vocabulary padding, fused and stacked layouts, replicated KV heads,
expert layouts, quantized layouts), and nothing is allocated. ``torch.distributed`` itself still answers world size
1: a model that asks torch (not vLLM) for the world size while it is built is sized as at TP=1 (docs/fit.md).

``build_rank`` returns what the prediction needs of that rank: parameter and buffer bytes, each attention layer's
KV-cache spec (vLLM's own ``get_kv_cache_spec`` over the model's layers), the shapes of its profile run (for the
formula) and, asked, the activation peak of that profile run measured on fake tensors (``profile_run``).
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from pytest_enginecheck.targets.vllm.fit import PARALLEL_STATE, RANK_GROUPS, FitError
from pytest_enginecheck.targets.vllm.fit.estimates import ProfileShapes

ATTENTION_LAYER = (("vllm.model_executor.layers.attention_layer_base", "AttentionLayerBase"),
                   ("vllm.attention.layer", "AttentionLayerBase"))
KV_CACHE_SPEC = (("vllm.v1.worker.gpu.attn_utils", "get_kv_cache_spec"),)
# vLLM's engine core resolves one KV-cache layout for the model from its attention backends before sizing the cache
ATTN_BACKENDS = (("vllm.distributed.kv_transfer.kv_connector.utils", "get_current_attn_backends"),)
SUPPORTED_LAYOUTS = (("vllm.v1.attention.backends.utils", "get_supported_kv_cache_layouts"),)
RESOLVE_LAYOUT = (("vllm.v1.attention.backends.utils", "resolve_kv_cache_layout"),)
NEEDED = "the fit prediction builds vLLM's model per rank with"


@dataclass
class RankModel:
    """What one rank's meta-built model holds: bytes, KV-cache specs by layer, the profile run's shapes."""

    rank: int
    weights_bytes: int
    buffers_bytes: int
    kv_cache_spec: dict[str, Any]  # layer name -> vLLM's KVCacheSpec (a layer sharing another's KV has none)
    profile: ProfileShapes
    # the profile run's torch activation peak measured on fake tensors (profile_run.py); None: not measured, and why
    activation_peak: int | None = None
    activation_peak_unmeasured: str = "not asked"
    parameters: dict[str, tuple[tuple[int, ...], str]] = field(default_factory=dict)  # name -> (shape, dtype)


def join_tp1_group(vllm_config: Any) -> None:
    """Join vLLM's distributed environment as the only rank (gloo), once per process, under ``vllm_config`` made
    current at TP=1: the groups ``rank_view`` copies. A process already in one (a test's, vLLM's own) keeps it."""
    import importlib
    import os

    from pytest_enginecheck.targets.vllm.checkpoints.vllm_build import INIT_DISTRIBUTED, INIT_MODEL_PARALLEL
    from pytest_enginecheck.targets.vllm.probe import engine_api, find

    state = importlib.import_module(PARALLEL_STATE)
    if getattr(state, "_TP", None) is not None:
        return
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    init, ensure = find(INIT_DISTRIBUTED, NEEDED), find(INIT_MODEL_PARALLEL, NEEDED)
    import torch.distributed as dist

    parallel = vllm_config.parallel_config
    tp = parallel.tensor_parallel_size
    parallel.tensor_parallel_size = 1
    try:
        if not dist.is_initialized():
            init(world_size=1, rank=0, local_rank=0, backend="gloo",
                 distributed_init_method=f"tcp://127.0.0.1:{engine_api().get_open_port()}")
        ensure(1, 1)
    finally:
        parallel.tensor_parallel_size = tp


@contextlib.contextmanager
def rank_view(tensor_parallel_size: int, rank: int) -> Iterator[None]:
    """While inside, vLLM's TP, world and expert groups answer world size ``tensor_parallel_size`` and rank ``rank``
    (copies of this process's TP=1 ``GroupCoordinator``s; the originals are put back on the way out)."""
    import importlib

    state = importlib.import_module(PARALLEL_STATE)
    saved: dict[str, Any] = {name: getattr(state, name, None) for name in RANK_GROUPS}
    try:
        for name, group in saved.items():
            # vLLM makes the expert group only where the current config was MoE when the process joined; at TP only
            # (no data or context parallelism) it has the TP group's members
            view = copy.copy(group if group is not None else saved["_TP"])
            view.world_size, view.rank_in_group, view.rank = tensor_parallel_size, rank, rank
            view.ranks = list(range(tensor_parallel_size))
            if hasattr(view, "group_ranks"):
                view.group_ranks = [view.ranks]
            setattr(state, name, view)
        yield
    finally:
        for name, group in saved.items():
            setattr(state, name, group)


def build_rank(vllm_config: Any, rank: int, with_parameters: bool = False,
               peaks: dict[Any, int | str] | None = None, collectives: str = "cuda",
               requested: int | None = None) -> RankModel:
    """vLLM's model for ``rank`` of ``vllm_config``'s tensor_parallel_size, built on the meta device under
    ``vllm_config`` (vLLM's ``initialize_model``, the engine's dtype); ``with_parameters`` also lists every
    parameter's shape and dtype. Given ``peaks``, it also runs vLLM's profile run on the model on fake tensors
    (``profile_run.measure``) for its activation peak, once per layout: ``peaks`` keeps, by the parameters' and
    buffers' names, shapes and dtypes, the peak or why it was not measured (the ranks of a TP-only engine mostly
    share one layout, and a run of a full-size model takes about a second); ``collectives``: whose collectives the
    run's allocate as ("cuda": the GPU engine's out-of-place all-reduce; "cpu": vLLM's CPU engine, for comparing
    with it). A rank whose weights alone exceed ``requested`` bytes (vLLM's share of the GPU) is not run: nothing
    fits it whatever its peak."""
    from pytest_enginecheck.targets.vllm.checkpoints.vllm_build import CURRENT_CONFIG, built_model
    from pytest_enginecheck.targets.vllm.fit.profile_run import FakeRunUnavailable, measure
    from pytest_enginecheck.targets.vllm.probe import find, model_initializer

    tp = vllm_config.parallel_config.tensor_parallel_size
    with find(CURRENT_CONFIG, NEEDED)(vllm_config):
        join_tp1_group(vllm_config)
    architecture = vllm_config.model_config.architecture
    with find(CURRENT_CONFIG, NEEDED)(vllm_config), rank_view(tp, rank):
        try:
            registered: dict[str, Any] = {}
            model = built_model(_registering(model_initializer(), registered), vllm_config, "meta")
            specs = _kv_cache_spec(vllm_config, model)
        except (NotImplementedError, RuntimeError) as e:
            if "meta" not in str(e):
                raise _unbuildable(architecture, rank, tp, e) from None
            raise FitError(f"vLLM's {type(e).__name__} building {architecture} on the meta device: its constructor "
                           f"reads a value of a tensor it made ({e}), which only a real allocation gives, so its full "
                           f"size cannot be predicted without allocating it") from None
        except Exception as e:  # noqa: BLE001 - vLLM refusing to build the model here, in its words
            raise _unbuildable(architecture, rank, tp, e) from None
        params = list(model.named_parameters())
        built = RankModel(
            rank=rank, weights_bytes=sum(p.numel() * p.element_size() for _, p in params),
            buffers_bytes=sum(b.numel() * b.element_size() for b in model.buffers()), kv_cache_spec=specs,
            profile=profile_shapes(vllm_config, model),
            parameters={n: (tuple(p.shape), str(p.dtype).removeprefix("torch.")) for n, p in params}
            if with_parameters else {})
        if peaks is not None:
            layout = tuple((n, tuple(t.shape), t.dtype) for n, t in [*params, *model.named_buffers()])
            if requested is not None and built.weights_bytes + built.buffers_bytes > requested:
                peaks[layout] = "not run: the weights alone exceed the requested memory"
            elif layout not in peaks:
                try:  # last: the run leaves the model eager, its fused-MoE layers with fake weights
                    peaks[layout] = measure(vllm_config, model, registered, collectives)
                except FakeRunUnavailable as e:
                    peaks[layout] = f"the fake run failed: {e}"
            peak = peaks[layout]
            if isinstance(peak, int):
                built.activation_peak = peak
            else:
                built.activation_peak_unmeasured = peak
    return built


def _registering(initialize_model: Any, registered: dict[str, Any]) -> Any:
    """``initialize_model`` that also keeps, in ``registered``, the layers the model registers in the config's static
    forward context while it is built (``built_model`` gives it a context of its own, dropped afterwards)."""

    def initialize(**kwargs: Any) -> Any:
        model = initialize_model(**kwargs)
        registered.update(kwargs["vllm_config"].compilation_config.static_forward_context)
        return model

    return initialize


def _unbuildable(architecture: str, rank: int, tp: int, error: BaseException) -> FitError:
    """vLLM's own error building the model here, as a FitError: most often a quantized layer whose kernel this vLLM
    build lacks on this machine (vLLM picks the kernel while it builds the layer)."""
    message = " ".join(str(error).split())[:600]
    return FitError(f"vLLM cannot build {architecture} for rank {rank} of tensor_parallel_size={tp} here: "
                    f"{type(error).__name__}: {message}. Fix: where vLLM names a kernel or a platform (a quantization "
                    f"method its CPU build lacks on this CPU), run the command where a vLLM build that has it is "
                    f"installed; otherwise the config.json has a field vLLM's class cannot build from")


def _kv_cache_spec(vllm_config: Any, model: Any) -> dict[str, Any]:
    """vLLM's own ``get_kv_cache_spec`` over the model's attention layers (put in the forward context it reads for
    the call; ``built_model`` built them in a context of their own); where this vLLM resolves a KV-cache layout
    (``cache_config.kv_cache_layout``), it is resolved from the layers' backends as vLLM's engine core does."""
    from pytest_enginecheck.targets.vllm.probe import find

    base = find(ATTENTION_LAYER, NEEDED)
    layers = {getattr(m, "layer_name", None) or name: m for name, m in model.named_modules() if isinstance(m, base)}
    compilation = vllm_config.compilation_config
    context = compilation.static_forward_context
    compilation.static_forward_context = layers
    try:
        specs = dict(find(KV_CACHE_SPEC, NEEDED)(vllm_config))
        cache = vllm_config.cache_config
        if hasattr(cache, "kv_cache_layout") and cache.kv_cache_layout is None:
            backends = find(ATTN_BACKENDS, NEEDED)(vllm_config)
            names = [layout.name for layout in find(SUPPORTED_LAYOUTS, NEEDED)(backends)]
            find(RESOLVE_LAYOUT, NEEDED)(vllm_config, [names], list(specs.values()))
        return specs
    finally:
        compilation.static_forward_context = context


def profile_shapes(vllm_config: Any, model: Any) -> ProfileShapes:
    """The shapes of this rank's profile run (``estimates.ProfileShapes``) from its layers: the largest linear
    layer's output per rank (with its activation: x1.5) or a fused MoE's per-token intermediates (top_k x (w13's
    output, its activation, w2's output))."""
    model_config = vllm_config.model_config
    size = model_config.dtype.itemsize
    text = model_config.hf_text_config
    top_k = int(getattr(text, "num_experts_per_tok", None) or getattr(text, "moe_topk", None) or 1)
    largest = 0
    for module in model.modules():
        out = getattr(module, "output_size_per_partition", None)
        if isinstance(out, int):
            largest = max(largest, out * 3 // 2)
        w13, w2 = getattr(module, "w13_weight", None), getattr(module, "w2_weight", None)
        if w13 is not None and w2 is not None and w13.dim() == 3:
            largest = max(largest, top_k * (w13.shape[1] * 3 // 2 + w2.shape[1]))
    hidden = int(model_config.get_hidden_size())
    return ProfileShapes(hidden_bytes_per_token=hidden * size, layer_bytes_per_token=largest * size,
                         vocab_size=int(model_config.get_vocab_size()), dtype_size=size)
