"""vLLM's profile run on one rank's full-size model, on fake tensors: its torch activation peak, measured, allocating
nothing.

vLLM's ``profile_run`` runs ``_dummy_run(max_num_batched_tokens, is_profile=True)`` (the model's forward over that
many tokens, split into ``min(tokens, max_num_seqs)`` requests) and ``_dummy_sampler_run`` over the last token of
each request (``compute_logits`` and the sampler, twice), and takes the torch allocator's peak as
``torch_peak_increase``. Here the rank's meta-built model (``rank_model``) gets fake parameters (torch's
``FakeTensorMode``: shapes, dtypes and storages, no data) and runs the same two steps under engine_ref's
``ActivationTracker``, which counts every tensor storage created until its last reference dies, as the engine
check counts vLLM's real profile run on CPU ranks (``engine/memory.py``). The full-size model runs in seconds.

Why the whole forward, attention included, and no stub: vLLM's profile run has no attention metadata (``_dummy_run``
builds it only for ``force_attention`` or full CUDA graphs), so no attention kernel runs, on the GPU as on the CPU:
each attention layer's op (``unified_attention_with_output``) writes zeros into the output the layer allocated, and
an MLA layer's also allocates a stand-in for its prefill workspace. Those ops, and every other op of vLLM's own
(namespaces ``vllm`` and ``vllm_ir``: fused MoE, RMSNorm's chosen implementation), run here by their Python
implementation on the fake tensors (``stand_ins``), not by their fake one (which returns the output alone), so what
they allocate is counted as in the engine. So the measured path is the profile run's own code; nothing is stubbed
but what a meta model or a lone process lacks, on the measured copy only: torch.compile is bypassed (the eager
forward, as ``enforce_eager`` runs it); linear layers whose CPU kernel is made while loading weights (which a meta
model never does) get vLLM's own fallback, ``F.linear``: the same output tensor; fused-MoE layers get their kernel
from vLLM's own ``process_weights_after_loading`` on the fake weights; a TP>1 rank's collectives have no peer
(``FakeCommunicator``: a tensor of the output's shape); and the two CPU-only sampling ops without a fake
implementation (``STAND_INS``) run as an argmax of the same output, the sampler's seeds read as 0.

What it measures is the CPU platform's ops (vLLM's CustomOps pick ``forward_cpu``; this vLLM runs RMSNorm
natively, in float32 intermediates), the torch allocator's exact bytes per storage. On CUDA, fused kernels keep
fewer intermediates, the caching allocator rounds each block up to 512 B, and some ops (the sampler's top-k/top-p)
take other paths: ``estimates.measured_activation_peak`` states the range that leaves. Where the fake run fails (an
op without a fake implementation, a model that reads a value of its input), ``measure`` raises
``FakeRunUnavailable`` and the prediction falls back to the formula (``estimates.activation_peak``), saying so.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

UNCOMPILED = "do_not_compile"  # vLLM's support_torch_compile: run the module eagerly


class FakeRunUnavailable(Exception):
    """The profile run cannot run on fake tensors for this model here; the message says why."""


@contextlib.contextmanager
def fake_parameters(model: Any, mode: Any) -> Iterator[list[Any]]:
    """While inside, every parameter and buffer of the meta-built ``model`` is a fake CPU tensor of ``mode`` with its
    shape, strides and dtype (tied ones stay tied); yields the fake tensors, for the tracker to leave uncounted. CPU,
    not meta: a forward that makes a constant on the default device must find the weights on the same device. The
    originals are put back on the way out: vLLM shares some modules between the models it builds in a process (its
    rotary embeddings, cached by their arguments)."""
    import torch

    fakes: dict[int, Any] = {}
    originals: list[tuple[dict[str, Any], str, Any]] = []
    with mode:
        for module in model.modules():
            for table in (module._parameters, module._buffers):
                for name, t in list(table.items()):
                    if t is not None:
                        if id(t) not in fakes:
                            fakes[id(t)] = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="cpu")
                        originals.append((table, name, t))
                        table[name] = fakes[id(t)]
    try:
        yield list(fakes.values())
    finally:
        for table, name, t in originals:
            table[name] = t


class FakeCommunicator:
    """A TP>1 rank's device communicator for the fake run, no peer: each collective returns a tensor of its output's
    shape, a new one as vLLM's collectives on CUDA do (its all-reduce is out of place: NCCL, custom and quick
    all-reduce); with ``platform="cpu"``, the all-reduce returns its input, as vLLM's CPU communicator reduces in
    place."""

    def __init__(self, world_size: int, rank: int, platform: str = "cuda") -> None:
        self.world_size, self.rank_in_group, self.platform = world_size, rank, platform

    def all_reduce(self, input_: Any) -> Any:
        import torch

        return input_ if self.platform == "cpu" else torch.empty_like(input_)

    def all_gather(self, input_: Any, dim: int = -1) -> Any:
        import torch

        shape = list(input_.shape)
        shape[dim] *= self.world_size
        return torch.empty(shape, dtype=input_.dtype, device=input_.device)

    def reduce_scatter(self, input_: Any, dim: int = -1) -> Any:
        import torch

        shape = list(input_.shape)
        shape[dim] //= self.world_size
        return torch.empty(shape, dtype=input_.dtype, device=input_.device)

    def gather(self, input_: Any, dst: int = 0, dim: int = -1) -> Any:
        return self.all_gather(input_, dim) if self.rank_in_group == dst else None


@contextlib.contextmanager
def fake_collectives(platform: str) -> Iterator[None]:
    """While inside, vLLM's groups of more than one rank (``rank_model.rank_view``'s copies) communicate through a
    FakeCommunicator of ``platform``'s collectives."""
    import importlib

    from pytest_enginecheck.targets.vllm.fit import PARALLEL_STATE, RANK_GROUPS

    state = importlib.import_module(PARALLEL_STATE)
    groups = [g for g in {id(g): g for g in (getattr(state, n, None) for n in RANK_GROUPS)}.values()
              if g is not None and g.world_size > 1]
    saved = [g.__dict__.get("device_communicator") for g in groups]
    for group in groups:
        group.device_communicator = FakeCommunicator(group.world_size, group.rank_in_group, platform)
    try:
        yield
    finally:
        for group, communicator in zip(groups, saved, strict=True):
            group.device_communicator = communicator


def stand_ins() -> Any:
    """A dispatch mode, above the tracker, that runs vLLM's own custom ops (``REAL_NAMESPACES``: attention, MLA, fused
    MoE, RMSNorm) by their Python implementation on the fake tensors, so what they allocate is counted as in the
    engine (MLA's profile-run stand-in for its prefill workspace: only its real implementation makes it; the fake one
    returns the output alone); the CPU-only ops without a fake implementation as ``STAND_INS``; every other op as it
    is. With ``sampling`` set, a value read (``.item()``: the sampler's per-request seeds, which size nothing) is 0."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    REAL_KEYS = (torch._C.DispatchKey.CPU, torch._C.DispatchKey.CompositeExplicitAutograd)

    class StandIns(TorchDispatchMode):
        sampling = False

        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            name, kwargs = str(func.name()), kwargs or {}
            if self.sampling and name in ("aten::item", "aten::_local_scalar_dense"):
                return 0
            if name in STAND_INS:
                return STAND_INS[name](*args, **kwargs)
            if func.namespace in REAL_NAMESPACES:
                for key in REAL_KEYS:
                    if func.has_kernel_for_dispatch_key(key):
                        return func._op_dk(key, *args, **kwargs)
            return func(*args, **kwargs)

    return StandIns()


# vLLM's Python-implemented custom ops (its layers' ops and its IR ops: RMSNorm's implementation the platform picks)
REAL_NAMESPACES = ("vllm", "vllm_ir")
# vLLM's CPU-only sampling ops -> an op of the same output (one token id per row); Sampler.greedy_sample's CUDA path
STAND_INS: dict[str, Any] = {"_C::greedy_argmax": lambda logits: logits.argmax(dim=-1).view(-1),
                             "_C::fused_gumbel_argmax": lambda logits, seeds: logits.argmax(dim=-1).view(-1)}


def eager(model: Any) -> None:
    """The measured copy runs eagerly, every linear layer on a kernel a meta model has (vLLM's own fallback)."""
    import torch.nn.functional as F

    for module in model.modules():
        if hasattr(module, UNCOMPILED):
            setattr(module, UNCOMPILED, True)
        if hasattr(module, "quant_method") and hasattr(module, "weight") and not hasattr(module, "cpu_linear"):
            module.cpu_linear = lambda x, weight, bias: F.linear(x, weight, bias)


def moe_kernels(model: Any, mode: Any) -> None:
    """What loading does for each fused-MoE layer that a meta model never loads: vLLM's own
    ``process_weights_after_loading`` of its method, which picks the experts' kernel (on fake weights, under
    ``mode``: their layout conversion allocates nothing)."""
    with mode:
        for module in model.modules():
            if hasattr(module, "w13_weight") and hasattr(module, "quant_method"):
                module.quant_method.process_weights_after_loading(module)


@contextlib.contextmanager
def forward_layers(vllm_config: Any, registered: dict[str, Any]) -> Iterator[None]:
    """The layers the model registered while it was built (attention layers, MoE runners: where vLLM's custom ops
    find them by name) as the config's static forward context, for as long as inside."""
    compilation = vllm_config.compilation_config
    saved = compilation.static_forward_context
    compilation.static_forward_context = registered
    try:
        yield
    finally:
        compilation.static_forward_context = saved


def dummy_sampling_metadata(logits: Any) -> Any:
    """``_dummy_sampler_run``'s sampling metadata: temperature 0.5, top-p 0.9, top-k vocabulary - 1, penalties."""
    import torch
    from vllm.v1.sample.logits_processor import LogitsProcessors
    from vllm.v1.sample.metadata import SamplingMetadata

    rows = logits.size(0)

    def full(value: float) -> Any:
        return torch.full((rows,), value, device=logits.device)

    return SamplingMetadata(
        temperature=full(0.5), all_greedy=False, all_random=False, top_p=full(0.9), top_k=full(logits.size(1) - 1),
        generators={}, max_num_logprobs=None, logprob_token_ids=None, no_penalties=True, prompt_token_ids=None,
        frequency_penalties=full(0.1), presence_penalties=full(0.1), repetition_penalties=full(0.1),
        output_token_ids=[[] for _ in range(rows)], spec_token_ids=[[] for _ in range(rows)],
        allowed_token_ids_mask=None, bad_words_token_ids={}, logitsprocs=LogitsProcessors())


def measure(vllm_config: Any, model: Any, registered: dict[str, Any], collectives: str = "cuda") -> int:
    """``profile_peak`` without torch's warning that vLLM's weight-reload bookkeeping asked a fake tensor for its data
    pointer (its storage's identity, while a fused-MoE layer's kernel is made), nor torch's log of an op that fails
    on fake tensors."""
    import logging
    import warnings

    # an op that fails on fake tensors is this run's FakeRunUnavailable (the formula stands in, its basis says why);
    # torch logs each such failure with its traceback as an error besides
    fake_tensor_log = logging.getLogger("torch._subclasses.fake_tensor")
    was_disabled, fake_tensor_log.disabled = fake_tensor_log.disabled, True
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="Accessing the data pointer of FakeTensor")
            return profile_peak(vllm_config, model, registered, collectives)
    finally:
        fake_tensor_log.disabled = was_disabled


def profile_peak(vllm_config: Any, model: Any, registered: dict[str, Any], collectives: str = "cuda") -> int:
    """The torch activation peak (bytes) of vLLM's profile run on ``model`` (this rank's meta-built model, under
    ``vllm_config`` and the rank's view of vLLM's groups; ``registered``: the layers it registered in its static
    forward context while built): the dummy forward at ``max_num_batched_tokens`` and the dummy sampler run, on fake
    tensors; a TP>1 rank's collectives allocate as on ``collectives`` ("cuda", or "cpu": FakeCommunicator).
    ``model`` keeps its parameters and buffers, but runs eagerly afterwards and its fused-MoE layers hold kernels and
    fake weights: measure last.

    Raises FakeRunUnavailable where the run does not go through on fake tensors."""
    import dataclasses

    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    from engine_ref.memory.tracker import ActivationTracker

    try:  # where a release moved them (0.34: the sampler of its new model runner), the formula stands in
        from vllm.config.model import PROCESSED_LOGPROBS_MODES
        from vllm.forward_context import set_forward_context
        from vllm.v1.sample.sampler import Sampler
    except ImportError as e:
        raise FakeRunUnavailable(f"this vLLM's profile run is not the one measured here ({e})") from None
    model_config, scheduler = vllm_config.model_config, vllm_config.scheduler_config
    tokens, seqs = scheduler.max_num_batched_tokens, scheduler.max_num_seqs
    requests = min(tokens, seqs)
    mode = FakeTensorMode()
    try:
        with fake_parameters(model, mode) as existing:
            eager(model)
            moe_kernels(model, mode)
            sampler = Sampler(logprobs_mode=model_config.logprobs_mode,
                              use_fp64_gumbel=getattr(model_config, "use_fp64_gumbel", False))
            with mode:  # the runner's persistent input buffers: made before the run, not counted
                input_ids = torch.zeros(tokens, dtype=torch.int32)
                positions = torch.zeros((3, tokens) if model_config.uses_mrope else (tokens,), dtype=torch.int64)
                # the last token of each request (tokens // requests each, the remainder in the last)
                logit_indices = torch.zeros(requests, dtype=torch.int64)
            standing_in = stand_ins()
            with (forward_layers(vllm_config, registered), fake_collectives(collectives), torch.inference_mode(), mode,
                  ActivationTracker([*existing, input_ids, positions, logit_indices]) as tracker, standing_in):
                with set_forward_context(None, vllm_config, num_tokens=tokens):
                    hidden_states = model(input_ids=input_ids, positions=positions, intermediate_tensors=None,
                                          inputs_embeds=None)
                if isinstance(hidden_states, tuple):  # auxiliary hidden states beside them
                    hidden_states = hidden_states[0]
                last = hidden_states[logit_indices]
                standing_in.sampling = True
                logits = model.compute_logits(torch.rand_like(last))
                metadata = dummy_sampling_metadata(logits)
                sampler(logits=logits, sampling_metadata=metadata)
                if sampler.logprobs_mode not in PROCESSED_LOGPROBS_MODES:
                    generator = torch.Generator(device="cpu")
                    sampler(logits=logits, sampling_metadata=dataclasses.replace(metadata, generators={0: generator}))
                del hidden_states, last, logits
            return int(tracker.peak_bytes)
    except Exception as e:  # noqa: BLE001 - any failure of the fake run: the formula stands in, saying why
        raise FakeRunUnavailable(f"{type(e).__name__}: {' '.join(str(e).split())[:300]}") from None
