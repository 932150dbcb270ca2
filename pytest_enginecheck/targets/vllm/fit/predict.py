"""The whole prediction: vLLM at TP=N on GPUs of a given size, from a config.json, in this (CPU) process.

For every rank: vLLM's config objects (``engine_config``), its model built for that rank on the meta device
(``rank_model``) and vLLM's profile run on it on fake tensors (``profile_run``: the activation peak, once per
layout), vLLM's sizing (``sizing``, with the GPU-only terms of ``estimates``) and its KV-cache functions
(``kv_cache``) at the three points of the range. Then the same at the other TP sizes of ``TRY_SIZES`` (rank 0 only:
the ranks of a TP-only engine build the same shapes, as every rank of the requested size shows), for the smallest
size that fits. Nothing full-size is allocated; vLLM's distributed state is joined once per process (TP=1, gloo).
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Iterable
from dataclasses import replace
from pathlib import Path

from pytest_enginecheck.targets.vllm.fit import FitError
from pytest_enginecheck.targets.vllm.fit.engine_config import (
    ServeArgs,
    derived_max_model_len,
    gpu_vllm_config,
    model_directory,
    read_config,
)
from pytest_enginecheck.targets.vllm.fit.estimates import (
    ESTIMATE_CUDA_GRAPHS,
    Estimate,
    activation_peak,
    cuda_graphs,
    measured_activation_peak,
    non_torch,
)
from pytest_enginecheck.targets.vllm.fit.platform import choose
from pytest_enginecheck.targets.vllm.fit.report import FitReport, RankFit
from pytest_enginecheck.targets.vllm.fit.sizing import GpuTerms, available_kv_cache_memory, requested_memory

TRY_SIZES = (1, 2, 4, 8)


def gpu_memory_bytes(gpu_memory: str | int) -> int:
    """``--gpu-memory`` in bytes ("80GiB", "141GB", a byte count); a FitError naming the value otherwise."""
    from engine_ref.errors import ConfigError
    from engine_ref.utils import parse_size

    try:
        return parse_size(gpu_memory, "gpu_memory")
    except ConfigError as e:
        raise FitError(str(e)) from None


def check_args(args: ServeArgs) -> None:
    """The arguments vLLM would refuse before looking at the model, refused here with the fix."""
    if args.tensor_parallel_size < 1:
        raise FitError(f"tensor_parallel_size={args.tensor_parallel_size}: give a positive number of GPUs, e.g. 2")
    if not (math.isfinite(args.gpu_memory_utilization) and 0 < args.gpu_memory_utilization <= 1):
        raise FitError(f"gpu_memory_utilization={args.gpu_memory_utilization}: give a fraction in (0, 1], e.g. 0.9")
    for name in ("max_model_len", "max_num_batched_tokens", "max_num_seqs", "block_size"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise FitError(f"{name}={value}: give a positive number, or leave it out for vLLM's default")


def predict_fit(config: str | Path, gpu_memory: str | int, args: ServeArgs | None = None,
                try_sizes: Iterable[int] = TRY_SIZES) -> FitReport:
    """Predict vLLM's startup at ``args.tensor_parallel_size`` on GPUs of ``gpu_memory`` each, from the config.json at
    ``config`` (``args``: vLLM's arguments, TP=1 and vLLM's defaults where None); also at each of ``try_sizes`` vLLM
    accepts (the report's ``sizes``, for the smallest that fits).

    Raises FitError for input the prediction cannot use (a missing or unreadable config, a bad size, arguments or an
    architecture vLLM refuses), with the value and the fix; VllmUnavailable where vLLM is not importable."""
    args = args or ServeArgs()
    total = gpu_memory_bytes(gpu_memory)
    check_args(args)
    read_config(config)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    imports = import_vllm()
    start = time.perf_counter()
    with model_directory(config) as model_dir:
        report = _predict(model_dir, str(config), args, total, None)
        sizes = {args.tensor_parallel_size: report.max_model_len_that_fits}
        for tp in sorted(set(try_sizes) - {args.tensor_parallel_size}):
            try:
                sizes[tp] = _predict(model_dir, str(config), replace(args, tensor_parallel_size=tp), total,
                                     (0,)).max_model_len_that_fits
            except FitError:  # vLLM refuses that size for this model (heads not divisible, ...): not a candidate
                continue
    return replace(report, sizes=sizes, seconds=time.perf_counter() - start, import_seconds=imports,
                   platform=choose() or "")


def import_vllm() -> float:
    """Import the parts of vLLM the prediction calls (seconds, once per process), and return how long it took;
    VllmUnavailable, saying so, where vLLM is not importable."""
    start = time.perf_counter()
    from pytest_enginecheck.targets.vllm.checkpoints.vllm_build import import_in_parent
    from pytest_enginecheck.targets.vllm.fit.kv_cache import candidates
    from pytest_enginecheck.targets.vllm.fit.rank_model import ATTENTION_LAYER, KV_CACHE_SPEC
    from pytest_enginecheck.targets.vllm.probe import find, probe

    choose()  # first: importing vLLM's registry resolves its platform
    probe()
    import_in_parent()
    for needed in (ATTENTION_LAYER, KV_CACHE_SPEC, candidates("get_kv_cache_groups")):
        find(needed, "the fit prediction calls")
    return time.perf_counter() - start


def _estimates_cuda_graphs() -> bool:
    """Whether this vLLM subtracts its CUDA-graph estimate from the KV cache's memory: its
    ``VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS`` (on by default since 0.21; a release without the variable does not)."""
    import vllm.envs as envs

    return bool(getattr(envs, ESTIMATE_CUDA_GRAPHS, False))


def _predict(model_dir: Path, label: str, args: ServeArgs, total: int, ranks: Iterable[int] | None) -> FitReport:
    from pytest_enginecheck.targets.vllm.fit.kv_cache import kv_fit, kv_layout
    from pytest_enginecheck.targets.vllm.fit.rank_model import build_rank

    vllm_config = gpu_vllm_config(model_dir, args, total)
    bound = derived_max_model_len(vllm_config)
    tp = vllm_config.parallel_config.tensor_parallel_size
    scheduler, cache = vllm_config.scheduler_config, vllm_config.cache_config
    batched, seqs = scheduler.max_num_batched_tokens, scheduler.max_num_seqs
    fits: list[RankFit] = []
    peaks: dict[object, int | str] = {}
    graphs = cuda_graphs(bool(vllm_config.model_config.enforce_eager), _estimates_cuda_graphs())
    for r in range(tp) if ranks is None else ranks:
        model = build_rank(vllm_config, r, peaks=peaks,
                           requested=requested_memory(total, cache.gpu_memory_utilization))
        layout = kv_layout(vllm_config, model.kv_cache_spec)
        peak = (measured_activation_peak(model.activation_peak, batched, seqs) if model.activation_peak is not None
                else activation_peak(model.profile, batched, seqs, model.activation_peak_unmeasured))
        terms = GpuTerms(peak, non_torch(tp), graphs)
        available = available_kv_cache_memory(total, cache.gpu_memory_utilization,
                                              model.weights_bytes + model.buffers_bytes, terms)
        low, mid, high = (kv_fit(vllm_config, model.kv_cache_spec, layout, a, bound)
                          for a in (available.low, available.estimate, available.high))
        basis = "from the available KV cache memory's range"
        fits.append(RankFit(
            rank=r, weights_bytes=model.weights_bytes, buffers_bytes=model.buffers_bytes,
            kv_bytes_per_token=layout.bytes_per_token, kv_one_request_bytes=layout.one_request_bytes,
            kv_layers=layout.layers, kv_spec=layout.description, terms=terms, available_kv_cache_memory=available,
            num_blocks=Estimate(low.num_blocks, mid.num_blocks, high.num_blocks, basis),
            kv_cache_bytes=Estimate(low.kv_cache_bytes, mid.kv_cache_bytes, high.kv_cache_bytes, basis),
            kv_tokens=Estimate(low.tokens, mid.tokens, high.tokens, basis),
            max_concurrency_x100=Estimate(int(low.max_concurrency * 100), int(mid.max_concurrency * 100),
                                          int(high.max_concurrency * 100), basis),
            max_model_len_that_fits=Estimate(low.max_model_len_that_fits, mid.max_model_len_that_fits,
                                             high.max_model_len_that_fits, basis)))
    longest = Estimate(min(f.max_model_len_that_fits.low for f in fits),
                       min(f.max_model_len_that_fits.estimate for f in fits),
                       min(f.max_model_len_that_fits.high for f in fits), "the smallest over the ranks")
    return FitReport(
        config=label, architecture=vllm_config.model_config.architecture, tensor_parallel_size=tp, gpu_memory=total,
        gpu_memory_utilization=cache.gpu_memory_utilization, max_model_len=vllm_config.model_config.max_model_len,
        derived_max_model_len=bound, dtype=str(vllm_config.model_config.dtype).removeprefix("torch."),
        kv_cache_dtype=str(cache.cache_dtype), block_size=cache.block_size, max_num_batched_tokens=batched,
        max_num_seqs=seqs, enforce_eager=bool(vllm_config.model_config.enforce_eager), ranks=fits,
        max_model_len_that_fits=longest)
