"""vLLM's per-rank memory on CPU ranks: weights and buffers as vLLM's own model constructor sizes them
for this rank, the KV cache vLLM allocated and its spec's bytes for one request, and the activation
peak of vLLM's own profile run.

vLLM's CPU backend moves linear weights into packed kernels after loading (the parameters become
empty), sizes the KV cache from VLLM_CPU_KVCACHE_SPACE and does not profile activations. So weights
are counted on a meta-device copy built by vLLM's ``initialize_model`` in the rank's own
tensor-parallel group (exact per-rank shapes, no allocation), and the peak is measured by engine_ref's
own ActivationTracker (one tracker for both targets): every tensor storage created while ``profile_run``
runs is counted until its last reference dies (a view of a freed tensor keeps it counted, also under
``torch.inference_mode``, where vLLM's dummy run runs); exact bytes, not RSS.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from pytest_enginecheck.targets.vllm.checkpoints.vllm_build import meta_model


@dataclass(frozen=True)
class RankMemory:
    """One rank's memory, in bytes. ``needs`` (what the budget check holds against the budget) counts one request's
    KV, not the KV cache vLLM allocated: that is sized from VLLM_CPU_KVCACHE_SPACE, whatever the budget says."""

    rank: int
    weights: int
    buffers: int
    activation_peak: int
    kv_cache_allocated: int  # what vLLM allocated (VLLM_CPU_KVCACHE_SPACE); not in ``needs``
    kv_one_request: int  # what one request of max_model_len needs (vLLM's KV cache spec); in ``needs``

    @property
    def needs(self) -> int:
        """weights + buffers + activation_peak + kv_one_request."""
        return self.weights + self.buffers + self.activation_peak + self.kv_one_request

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "needs": self.needs}


def _storage_bytes(tensors: Any) -> int:
    seen: dict[int, int] = {}
    for t in tensors:
        storage = t.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def flat_tensors(value: Any) -> list[Any]:
    """The tensors in ``value``: a tensor, or dicts, lists and tuples of them (vLLM's ``kv_caches``)."""
    import torch

    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in flat_tensors(v)]
    return []


def activation_peak(fn: Any, existing: Any = ()) -> int:
    """The peak bytes of tensor storages created while ``fn()`` runs; ``existing`` tensors' storages (weights,
    buffers, the KV cache) and their views are not counted."""
    from engine_ref.memory.tracker import ActivationTracker

    with ActivationTracker(existing) as tracker:
        fn()
    return tracker.peak_bytes


def existing_storages(runner: Any) -> list[Any]:
    """What a step of ``runner`` (vLLM's model runner) does not create: the model's parameters and buffers, the KV
    cache."""
    return [*runner.model.parameters(), *runner.model.buffers(), *flat_tensors(runner.kv_caches)]


def _bytes(tensors: Any) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def rank_memory(worker: Any) -> dict[str, Any]:
    """Run on each vLLM worker (``LLM.collective_rpc``): that rank's RankMemory as a dict."""
    runner = worker.model_runner
    model = meta_model(worker.vllm_config)
    spec = worker.get_kv_cache_spec()
    one_request = sum(s.max_memory_usage_bytes(worker.vllm_config) for s in spec.values())
    kv_caches = flat_tensors(runner.kv_caches)
    peak = activation_peak(runner.profile_run, existing_storages(runner))
    return RankMemory(rank=worker.rank, weights=_bytes(model.parameters()),
                      buffers=_bytes(model.buffers()), activation_peak=peak,
                      kv_cache_allocated=_storage_bytes(kv_caches), kv_one_request=one_request).to_dict()
