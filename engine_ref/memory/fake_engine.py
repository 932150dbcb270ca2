"""The engine's startup, every rank in this process, on fake tensors: what ``estimate_memory`` runs.

Each rank is the engine's own Worker, driven through the calls the executor makes, under
``fake_tensors()`` (shapes without storage) and a simulated tensor-parallel group:

    Worker(config, rank)                       as the executor makes it
    worker.load_model()                        load_format 'dummy': initialize_model, on-the-fly quantization
                                               (process_weights_after_loading), module_bytes, LoRA slots
    worker.determine_available_memory()        the profile run under ActivationTracker
    worker.get_kv_cache_spec()                 per-layer KV pages
then EngineCore's sizing (``kv_cache.sizing.size_kv_cache``) over every rank's memory: the blocks
the engine would allocate, and whether one request of max_model_len can be served. Only
``init_device`` is skipped (it would join a process group); FakeRank gives the worker its device
capacity, as init_device does on CPU, and at TP>1 a fake default process group of its rank and world
size (``fake_group``), so a model that asks torch.distributed for its rank is answered as in the engine.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from engine_ref.config import EngineConfig, valid_tensor_parallel_sizes
from engine_ref.distributed.parallel_state import tensor_parallel_state
from engine_ref.errors import ConfigError, EngineRefError, MissingConfigField
from engine_ref.kv_cache.sizing import (
    DEFAULT_MAX_NUM_BATCHED_TOKENS,
    KVCacheSizing,
    default_max_num_batched_tokens,
    size_kv_cache,
)
from engine_ref.kv_cache.spec import FullAttentionSpec, bytes_per_block
from engine_ref.memory.accounting import MemoryUsage, module_bytes
from engine_ref.memory.fake import fake_tensors
from engine_ref.memory.fake_group import fake_process_group
from engine_ref.memory.result import MemoryEstimate
from engine_ref.model_executor.layers.quantization.base_config import process_weights_after_loading
from engine_ref.model_executor.model_loader.loaders import initialize_model
from engine_ref.utils import cdiv, format_bytes
from engine_ref.worker.worker import Worker

#: The search for the largest max_model_len that fits re-runs the profile at each length it tries.
#: It tries no length that cuts the profile batch into more than this many sequences (a fake run's
#: time grows with the number of sequences, not with their length), and at most MAX_SEARCH_STEPS.
MAX_SEARCH_SEQUENCES = 64
MAX_SEARCH_STEPS = 24


@contextmanager
def building(config: EngineConfig, label: str, rank: int = 0, world_size: int | None = None) -> Iterator[None]:
    """Turn a model constructor's failure on the config's sizes (one tensor parallelism cannot split,
    a negative one) into a ConfigError naming those sizes and the fix."""
    tp = world_size or config.parallel_config.tensor_parallel_size
    try:
        yield
    except MissingConfigField as e:  # raised by the model's constructor: say which config.json
        raise MissingConfigField(f"{config.model_config.architecture} from {label}: {e}") from None
    except EngineRefError:
        raise
    except (ValueError, RuntimeError, TypeError) as e:
        model = config.model_config
        sections = (("", model.hf_text_config), ("vision_config.", model.hf_config.get("vision_config") or {}))
        sizes = {f"{prefix}{name}": value for prefix, section in sections for name, value in section.items()
                 if name.endswith("_size") and isinstance(value, int) and not isinstance(value, bool)}
        negative = [f"{name}={value}" for name, value in sizes.items() if value <= 0]
        uneven = [f"{name}={value}" for name, value in sizes.items()
                  if value > 0 and value % tp and name != "vocab_size"]  # the vocabulary is padded to a multiple
        valid = valid_tensor_parallel_sizes(model.hf_config)
        if negative:
            fix = f"config.json has sizes that must be positive: {', '.join(negative)}"
        elif uneven:
            fix = (f"config.json has sizes that tensor_parallel_size={tp} does not divide: {', '.join(uneven)}; "
                   f"choose a tensor_parallel_size that divides them (valid sizes: {valid})")
        else:
            fix = "check config.json's sizes"
        raise ConfigError(
            f"{model.architecture} from {label} cannot be built for rank {rank} of tensor_parallel_size={tp} "
            f"({e}): {fix}."
        ) from None


class FakeRank:
    """One rank's Worker, with its model built on fake tensors under a simulated TP group."""

    def __init__(self, config: EngineConfig, rank: int, label: str, capacity: int) -> None:
        self.rank = rank
        self.worker = Worker(config, rank)
        self.worker.memory = MemoryUsage(capacity=capacity)  # init_device's part
        with self._tp_group(), building(config, label, rank):
            self.worker.load_model()
        if self.worker.model is None:
            raise RuntimeError("Worker.load_model() left no model")
        self.model: torch.nn.Module = self.worker.model
        self.specs: dict[str, FullAttentionSpec] = self.worker.get_kv_cache_spec()

    @contextmanager
    def _tp_group(self) -> Iterator[None]:
        with tensor_parallel_state(self.rank, self.worker.world_size), \
                fake_process_group(self.rank, self.worker.world_size):
            yield

    def profile(self) -> None:
        """The worker's determine_available_memory: the profile run, which sets its activation peak."""
        with self._tp_group():
            self.worker.determine_available_memory()

    @property
    def signature(self) -> tuple:
        """What the profile run's memory depends on: every parameter's and buffer's name, shape, dtype."""
        return tuple((name, tuple(t.shape), t.stride(), t.dtype)
                     for name, t in [*self.model.named_parameters(), *self.model.named_buffers()])

    @property
    def weights(self) -> int:
        return self.worker.memory.weights

    @property
    def buffers(self) -> int:
        return self.worker.memory.buffers

    @property
    def lora(self) -> int:
        return self.worker.memory.lora

    @property
    def activation_peak(self) -> int:
        return self.worker.memory.activation_peak

    @property
    def kv_bytes_per_token(self) -> int:
        return bytes_per_block(self.specs) // self.worker.config.cache_config.block_size


class FakeEngine:
    """Every rank of one engine configuration, and EngineCore's KV cache sizing over them."""

    def __init__(self, config: EngineConfig, label: str, max_num_batched_tokens: int | None) -> None:
        capacity, requested = config.device_config.capacity_bytes, config.model_config.max_model_len
        if capacity is None:
            raise ValueError("FakeEngine needs a validated EngineConfig with the device capacity set")
        self.config, self.label = config, label
        self.capacity, self.requested = capacity, requested
        self.fixed_batch_tokens = max_num_batched_tokens  # None: the engine's default, which follows max_model_len

    def estimate(self) -> MemoryEstimate:
        """Build every rank, run its profile, size the KV cache; search a max_model_len if it does not fit."""
        config = self.config
        model, cache, requested = config.model_config, config.cache_config, self.requested
        num_parameters, weight_bytes, buffer_bytes = self.whole_model()
        with fake_tensors():
            ranks = [FakeRank(config, rank, self.label, self.capacity)
                     for rank in range(config.parallel_config.tensor_parallel_size)]
            self.profile(ranks)
            peaks = [rank.activation_peak for rank in ranks]  # the search below re-runs the profile
            sizing = self.sizing(ranks)
            overflow, reason = self.verdict(ranks, sizing)
            largest = requested if overflow is None else self.largest_fitting_len(ranks, sizing)
            self.set_max_model_len(requested)
        return MemoryEstimate(
            architecture=model.architecture,
            num_parameters=num_parameters,
            dtype=model.dtype,
            tensor_parallel_size=len(ranks),
            weight_bytes=weight_bytes,
            buffer_bytes=buffer_bytes,
            weight_bytes_per_rank=[rank.weights for rank in ranks],
            buffer_bytes_per_rank=[rank.buffers for rank in ranks],
            lora_bytes_per_rank=[rank.lora for rank in ranks],
            activation_peak_bytes_per_rank=peaks,
            kv_cache_bytes_per_token_per_rank=[rank.kv_bytes_per_token for rank in ranks],
            block_size=cache.block_size,
            num_gpu_blocks=sizing.num_blocks,
            max_concurrency=sizing.largest_max_model_len / requested,
            fits=overflow is None,
            reason=reason,
            max_model_len_estimate=largest,
            max_model_len=requested,
            max_num_batched_tokens=config.scheduler_config.max_num_batched_tokens,
            device_memory_bytes=self.capacity,
            gpu_memory_utilization=cache.gpu_memory_utilization,
            budget_bytes=sizing.budget_bytes[0],
            overflow=overflow,
            all_reduce_bytes=self.all_reduce_bytes(len(ranks)),
        )

    def all_reduce_bytes(self, tensor_parallel_size: int) -> int:
        """Bytes of one activation the ranks all-reduce (a hidden state of the profile batch); 0 at TP=1."""
        if tensor_parallel_size == 1:
            return 0
        model = self.config.model_config
        tokens = self.config.scheduler_config.max_num_batched_tokens
        return tokens * model.hf_text_config.hidden_size * model.torch_dtype.itemsize

    def whole_model(self) -> tuple[int, int, int]:
        """(parameters, weight bytes, buffer bytes) of the unsharded model (TP=1, on the meta device;
        shared tensors once)."""
        with tensor_parallel_state(0, 1), building(self.config, self.label, world_size=1):
            whole = initialize_model(self.config, torch.device("meta"))
            process_weights_after_loading(whole)  # quantized on the fly: the 8-bit weights and their scales
        return sum(p.numel() for p in whole.parameters()), *module_bytes(whole)

    def profile(self, ranks: list[FakeRank]) -> None:
        """Every rank's profile run; one per distinct shard shape.

        Ranks whose parameters and buffers have the same names, shapes and dtypes run the same
        operators on the same shapes (the rank only changes which rows they hold), so the profile
        run of the first stands for the others.
        """
        first: dict[tuple, FakeRank] = {}
        for rank in ranks:
            twin = first.setdefault(rank.signature, rank)
            if twin is rank:
                rank.profile()
            else:
                rank.worker.memory.activation_peak = twin.activation_peak

    def sizing(self, ranks: list[FakeRank]) -> KVCacheSizing:
        """EngineCore's KV cache sizing over the ranks' memory, at the config's current max_model_len."""
        cache = self.config.cache_config
        return size_kv_cache([rank.worker.memory for rank in ranks],
                             gpu_memory_utilization=cache.gpu_memory_utilization,
                             bytes_per_block=bytes_per_block(ranks[0].specs), block_size=cache.block_size,
                             max_model_len=self.config.model_config.max_model_len,
                             num_blocks_override=cache.num_gpu_blocks_override)

    def verdict(self, ranks: list[FakeRank], sizing: KVCacheSizing) -> tuple[str | None, str | None]:
        """(the category that does not fit, why), or (None, None) when a max_model_len request fits."""
        cache = self.config.cache_config
        heaviest = max(ranks, key=lambda r: r.weights + r.buffers)
        budget = sizing.budget_bytes[heaviest.rank]
        share = f"{cache.gpu_memory_utilization} x {format_bytes(self.capacity)} = {format_bytes(budget)}"
        if heaviest.weights + heaviest.buffers > budget:
            return "weights", (
                f"the weights of rank {heaviest.rank} ({format_bytes(heaviest.weights)}, buffers "
                f"{format_bytes(heaviest.buffers)}) exceed its budget of {share}; raise tensor_parallel_size, the "
                f"device memory or gpu_memory_utilization."
            )
        lora_config = self.config.lora_config
        heaviest = max(ranks, key=lambda r: r.weights + r.buffers + r.lora)
        if lora_config is not None and heaviest.weights + heaviest.buffers + heaviest.lora > budget:
            return "lora", (
                f"the LoRA adapter slots of rank {heaviest.rank} (max_loras={lora_config.max_loras} x "
                f"max_lora_rank={lora_config.max_lora_rank}: {format_bytes(heaviest.lora)}) do not fit beside its "
                f"weights ({format_bytes(heaviest.weights)}, buffers {format_bytes(heaviest.buffers)}) in its budget "
                f"of {share}; lower max_loras or max_lora_rank, or raise tensor_parallel_size, the device memory or "
                f"gpu_memory_utilization."
            )
        rank = ranks[sizing.rank]
        lora, lower_lora = "", ""
        if rank.lora:
            lora, lower_lora = f", LoRA slots ({format_bytes(rank.lora)})", ", max_loras or max_lora_rank"
        if sizing.available_bytes[rank.rank] <= 0:
            return "activation_peak", (
                f"the weights of rank {rank.rank} ({format_bytes(rank.weights)}, buffers {format_bytes(rank.buffers)})"
                f"{lora} and the activation peak of its profile run of "
                f"{self.config.scheduler_config.max_num_batched_tokens} tokens ({format_bytes(rank.activation_peak)}) "
                f"exceed its budget of {share}, leaving nothing for the KV cache; lower max_num_batched_tokens or "
                f"max_model_len{lower_lora}, or raise tensor_parallel_size, the device memory or "
                f"gpu_memory_utilization."
            )
        if not sizing.fits:
            return "kv_cache", (
                f"one request of max_model_len {sizing.max_model_len} needs {format_bytes(sizing.request_bytes)} of "
                f"KV cache on rank {rank.rank}, but only {format_bytes(sizing.available_bytes[rank.rank])} is left "
                f"after weights ({format_bytes(rank.weights)}), buffers ({format_bytes(rank.buffers)}){lora} and the "
                f"activation peak ({format_bytes(rank.activation_peak)}): {sizing.num_blocks} blocks of "
                f"{sizing.block_size} tokens; lower max_model_len{lower_lora}, or raise tensor_parallel_size, the "
                f"device memory or gpu_memory_utilization."
            )
        return None, None

    # -- the largest max_model_len that fits ------------------------------------------------------

    def set_max_model_len(self, max_len: int) -> None:
        """Point the (estimate-private) config at another max_model_len, with the engine's batch default."""
        self.config.model_config.max_model_len = max_len
        if self.fixed_batch_tokens is None:
            self.config.scheduler_config.max_num_batched_tokens = default_max_num_batched_tokens(max_len)

    def slack_at(self, ranks: list[FakeRank], max_len: int) -> int:
        """``KVCacheSizing.slack_tokens`` at another max_model_len: the profile run is re-run at that length."""
        self.set_max_model_len(max_len)
        self.profile(ranks)
        return self.sizing(ranks).slack_tokens

    def largest_fitting_len(self, ranks: list[FakeRank], sizing: KVCacheSizing) -> int:
        """The largest max_model_len below the requested one that fits; always a length tried (0: none).

        The activation peak grows with max_model_len (the profile batch follows it), so the slack
        ``s(L) = n(L) * block_size - L`` falls as L grows, and L fits when ``s(L) >= 0``. The search
        keeps the longest length known to fit (lo) and the shortest known not to (hi) and tries
        where the secant of ``s`` through the last lengths tried on either side crosses zero
        (halving when one side repeats); after a length that fits, ``n(lo) * block_size`` also
        bounds the answer. A few profile runs. Lengths below ``search_floor()`` are not tried.
        """
        if any(rank.weights + rank.buffers + rank.lora > sizing.budget_bytes[rank.rank] for rank in ranks):
            return 0
        lo, hi, floor = 0, self.requested, self.search_floor()
        above = (hi, sizing.slack_tokens)  # the last length tried that does not fit, its slack
        below: tuple[int, int] | None = None  # the last length tried that fits, its slack
        last_fit, same_side = None, 0
        for _ in range(MAX_SEARCH_STEPS):
            if hi - lo <= 1:
                break
            if below is None:
                guess = above[0] + above[1]  # n(L) * block_size: what the engine suggests, fits when n > 0
            else:
                (x0, s0), (x1, s1) = below, above
                guess = x0 + s0 * (x1 - x0) // (s0 - s1)  # where the secant of s crosses zero
            if same_side >= 2 or not lo < guess < hi:
                guess = (lo + hi) // 2
            candidate = max(guess, floor, lo + 1)
            if candidate >= hi:
                break
            slack = self.slack_at(ranks, candidate)
            fits = slack >= 0
            same_side = same_side + 1 if fits == last_fit else 1
            last_fit = fits
            if fits:
                lo, below = candidate, (candidate, slack)
                hi = min(hi, candidate + slack + 1)  # nothing longer than n(lo) * block_size fits
            else:
                hi, above = candidate, (candidate, slack)
        return lo

    def search_floor(self) -> int:
        """The shortest max_model_len searched: its profile batch has at most MAX_SEARCH_SEQUENCES sequences."""
        return cdiv(self.fixed_batch_tokens or DEFAULT_MAX_NUM_BATCHED_TOKENS, MAX_SEARCH_SEQUENCES)
