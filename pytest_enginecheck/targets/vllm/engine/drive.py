"""One vLLM ``LLM`` in this process: start it on a checkpoint, generate the fixed prompts (with a LoRA adapter
too, where one is given), run a function on every worker, measure each rank's memory, shut it down.

What the engine calls of vLLM comes from the probe (``probe.engine_api``); a failure is an EngineStartError naming
phase and rank (``failures.classify``).
"""

from __future__ import annotations

import inspect
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from typing import Any

from pytest_enginecheck.prompts import prompt_lengths, prompt_tokens
from pytest_enginecheck.targets.vllm.checkpoints.args import checkpoint_args
from pytest_enginecheck.targets.vllm.checkpoints.reading import special_ids, vocab_size
from pytest_enginecheck.targets.vllm.env import BLOCK_SIZE, ENGINE_ARGS, MAX_MODEL_LEN
from pytest_enginecheck.targets.vllm.failures import EngineFailure, classify
from pytest_enginecheck.targets.vllm.probe import VllmUnavailable, engine_api, find, logprobs_api

SHUTDOWN_GRACE_S = 10.0  # for all ranks together, from the last answer: how long they may take to exit by themselves

MAX_TOKENS = 6
LOGPROBS = 20  # top-k log-probabilities per position: vLLM's default max_logprobs, so no engine argument changes
# Which prompts of the shared design (pytest_enginecheck/prompts.py) vLLM runs: the one whose decoding opens a new KV
# block, the one whose prefill spans two blocks, and the longest, whose last token sits at max_model_len. Three, as
# before (the tier's tests count them). Together they exceed max_num_batched_tokens, so vLLM prefills the longest in
# chunks, one ending inside a block.
PROMPTS = (1, 2, 4)


class EngineStartError(Exception):
    """vLLM failed to start, generate or stop on some rank; ``failure`` says where."""

    def __init__(self, failure: EngineFailure, message: str) -> None:
        super().__init__(message)
        self.failure = failure


@dataclass
class EngineRun:
    """One start of vLLM's engine: what it generated, what each rank held, how long each step took."""

    tp: int
    mode: str
    tokens: list[list[int]]
    memory: list[dict[str, Any]]
    seconds: dict[str, float] = field(default_factory=dict)
    captures: list[Any] = field(default_factory=list)  # per rank, what EngineWork's worker functions returned
    # Per prompt, per position of prompt + generated tokens from position 1 on: {token id: log-probability} of
    # the top LOGPROBS tokens and the actual one (ids as strings: a run is cached as JSON). Empty: not asked.
    logprobs: list[list[dict[str, float]]] = field(default_factory=list)
    logprobs_unavailable: str = ""  # why vLLM gave none (probe.logprobs_api), when it did not
    # A start with a LoRA adapter (EngineWork.lora_adapter): the same prompts' tokens and log-probabilities with
    # the adapter; ``tokens`` and ``logprobs`` are then the base model's from the same engine.
    lora_tokens: list[list[int]] = field(default_factory=list)
    lora_logprobs: list[list[dict[str, float]]] = field(default_factory=list)
    # The ranks that did not exit by themselves within the shutdown grace after answering and were killed: [{"rank",
    # "stacks"}] (ranks.py), the stacks read before the kill.
    killed_ranks: list[dict[str, Any]] = field(default_factory=list)
    # The same prompts generated again by the same engine after every worker reseeded torch with OTHER_SEED (a start
    # without an adapter): its tokens, and per prompt the generated tokens' log-probabilities. Empty: not run.
    tokens_other_seed: list[list[int]] = field(default_factory=list)
    logprobs_other_seed: list[list[dict[str, float]]] = field(default_factory=list)
    # The budget check's workload (workload.py; a start without an adapter): per round, each rank's step memory
    # ({"rank", "peaks", "held", "steps"}: engine_ref's WorkloadMemory as a dict). Empty: not run.
    workload: list[list[dict[str, Any]]] = field(default_factory=list)
    # What the start left behind once its ranks had exited (checks/leftovers.py: processes, descriptors, sockets,
    # shared memory, entries in /tmp or the working directory), as plain sentences.
    leftovers: list[str] = field(default_factory=list)
    dtype: str = ""  # the engine's dtype, as the check that started it asked (ENGINE_ARGS' unless it said)


OTHER_SEED = 1  # the determinism run's seed (ENGINE_ARGS' is 0)


def reseed(worker: Any) -> None:
    """Run on every worker (``collective_rpc``): torch's generators reseeded with OTHER_SEED."""
    import torch

    torch.manual_seed(OTHER_SEED)


def prompts(vocab_size: int, avoid: Collection[int] = ()) -> list[list[int]]:
    """The fixed prompts (``PROMPTS``) for BLOCK_SIZE, MAX_MODEL_LEN and MAX_TOKENS, inside the vocabulary and
    without the ids of ``avoid``."""
    lengths = prompt_lengths(BLOCK_SIZE, MAX_MODEL_LEN, MAX_TOKENS)
    return prompt_tokens([lengths[i] for i in PROMPTS], vocab_size, avoid)


def checkpoint_prompts(ckpt: str) -> list[list[int]]:
    """The fixed prompts in the vocabulary of ``ckpt``, without the token ids its config.json gives a role."""
    return prompts(vocab_size(ckpt), special_ids(ckpt))


def _logprobs(output: Any) -> list[dict[str, float]]:
    """One RequestOutput's log-probabilities by position: its prompt's (the first token has none), then its tokens'."""
    positions = [*(output.prompt_logprobs or [])[1:], *(output.outputs[0].logprobs or [])]
    return [{str(token): float(lp.logprob) for token, lp in position.items()} for position in positions]


@dataclass(frozen=True)
class HookedPrefill:
    """Instead of generating: one prefill of ``prompt``, with ``install`` run on every worker before it and
    ``collect`` after it (``LLM.collective_rpc``), each rank's ``collect`` in ``EngineRun.captures``."""

    prompt: list[int]
    install: Callable[[Any], Any]
    collect: Callable[[Any], Any]


@dataclass(frozen=True)
class EngineWork:
    """What one start does besides generating the fixed prompts: generate them again with the PEFT adapter at
    ``lora_adapter`` (a LoRARequest; the caller's ``engine_args`` enable LoRA), run ``worker_rpc`` on every worker
    after generating (each rank's result in ``EngineRun.captures``), or only a ``hooked_prefill``."""

    lora_adapter: str | None = None
    worker_rpc: Callable[[Any], Any] | None = None
    hooked_prefill: HookedPrefill | None = None


def _hooked_prefill(llm: Any, hooked: HookedPrefill) -> list[Any]:
    """One prefill of ``hooked.prompt`` between ``hooked.install`` and ``hooked.collect`` on every worker."""
    llm.collective_rpc(hooked.install)
    llm.generate([{"prompt_token_ids": hooked.prompt}], engine_api().sampling_params(temperature=0.0, max_tokens=1),
                 use_tqdm=False)
    return list(llm.collective_rpc(hooked.collect))


def drive(ckpt: str, tp: int, mode: str, rank: int, extra: dict[str, Any], work: EngineWork) -> EngineRun:
    """Start vLLM's LLM in this process with ``extra`` arguments, generate and measure (or run ``work``'s hooked
    prefill), shut down."""
    from pytest_enginecheck.targets.vllm.engine.memory import rank_memory
    from pytest_enginecheck.targets.vllm.engine.workload import run_workload

    api = engine_api()
    adapter, rpc = work.lora_adapter, work.worker_rpc
    seconds: dict[str, float] = {}
    start = time.perf_counter()
    try:
        # extra may set the dtype; what the checkpoint needs (checkpoint_args): a composite's text decoder alone, ...
        llm = api.llm(model=ckpt, tensor_parallel_size=tp, **{**ENGINE_ARGS, **checkpoint_args(ckpt), **extra})
    except Exception as e:  # noqa: BLE001 - reported by phase and rank
        raise EngineStartError(classify(e, rank), str(e)) from None
    seconds["start"] = time.perf_counter() - start
    try:
        if work.hooked_prefill is not None:
            return EngineRun(tp, mode, [], [], seconds, captures=_hooked_prefill(llm, work.hooked_prefill))
        mark = time.perf_counter()
        asked: dict[str, Any] = {}
        unavailable = ""
        try:
            logprobs_api()
            # vLLM 0.32's CPU LoRA logits path fails on prompt log-probabilities (LogitsProcessorWithLoRA sizes its
            # indices by request, the prompt's logits by token): with an adapter, the generated tokens' only.
            asked = {"logprobs": LOGPROBS, **({} if adapter else {"prompt_logprobs": LOGPROBS})}
        except VllmUnavailable as e:
            unavailable = str(e)
        params = api.sampling_params(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, **asked)
        outputs = llm.generate([{"prompt_token_ids": p} for p in checkpoint_prompts(ckpt)], params,
                               use_tqdm=False)
        tokens = [list(o.outputs[0].token_ids) for o in outputs]
        logprobs = [_logprobs(o) for o in outputs] if asked else []
        lora_tokens, lora_logprobs = _generate_with_lora(llm, ckpt, params, adapter) if adapter else ([], [])
        other_tokens: list[list[int]] = []
        other_logprobs: list[list[dict[str, float]]] = []
        if not adapter:  # the determinism run: a model whose output depends on torch's generators shows it here
            llm.collective_rpc(reseed)
            again = llm.generate([{"prompt_token_ids": p} for p in checkpoint_prompts(ckpt)], params, use_tqdm=False)
            other_tokens = [list(o.outputs[0].token_ids) for o in again]
            other_logprobs = [_logprobs(o)[-len(o.outputs[0].token_ids):] for o in again] if asked else []
        seconds["generate"] = time.perf_counter() - mark
        memory = llm.collective_rpc(rank_memory)
        captures = list(llm.collective_rpc(rpc)) if rpc is not None else []
        workload = [] if adapter else run_workload(llm, checkpoint_prompts(ckpt), MAX_TOKENS)
    except Exception as e:  # noqa: BLE001
        raise EngineStartError(classify(e, rank), str(e)) from None
    finally:
        mark = time.perf_counter()
        shutdown(llm)
        seconds["shutdown"] = time.perf_counter() - mark
    return EngineRun(tp, mode, tokens, memory, seconds, captures=captures, logprobs=logprobs,
                     logprobs_unavailable=unavailable, lora_tokens=lora_tokens,
                     lora_logprobs=lora_logprobs if asked else [], tokens_other_seed=other_tokens,
                     logprobs_other_seed=other_logprobs, workload=workload)


def _generate_with_lora(llm: Any, ckpt: str, params: Any, adapter: str) -> tuple[list[list[int]], list[Any]]:
    """The fixed prompts' greedy tokens and log-probabilities with the PEFT adapter at ``adapter`` (a LoRARequest)."""
    outputs = llm.generate([{"prompt_token_ids": p} for p in checkpoint_prompts(ckpt)], params, use_tqdm=False,
                           lora_request=lora_request(adapter))
    return [list(o.outputs[0].token_ids) for o in outputs], [_logprobs(o) for o in outputs]


LORA_REQUEST = (("vllm.lora.request", "LoRARequest"),)


def lora_request(adapter: str) -> Any:
    """vLLM's LoRARequest for the adapter directory ``adapter`` (one adapter, id 1)."""
    return find(LORA_REQUEST, "the lora check asks for its adapter with")("enginecheck", 1, adapter)


def shutdown(llm: Any) -> None:
    """Stop vLLM's engine core (and its processes) and this process's distributed state. In vLLM's own layout its
    engine-core process gets SHUTDOWN_GRACE_S to stop its workers (``VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS``, run.py),
    and three times that in all to exit (that grace, vLLM's wait between its SIGTERM and SIGKILL of a worker, its own
    teardown, all slower on a busy machine), where the release takes a timeout (vLLM's default is 5 s): on two busy
    cores a clean engine core outlived 5 s, was SIGKILLed by vLLM and left its shared-memory queues in /dev/shm. The
    wait ends as soon as the engine core exits, so only an engine core that hangs waits it out."""
    core = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
    if core is not None and hasattr(core, "shutdown"):
        if "timeout" in inspect.signature(core.shutdown).parameters:
            core.shutdown(timeout=3 * SHUTDOWN_GRACE_S)
        else:
            core.shutdown()
    cleanup = engine_api().cleanup
    if cleanup is not None:
        cleanup()
