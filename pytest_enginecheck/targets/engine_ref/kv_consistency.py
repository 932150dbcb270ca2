"""Decode with the KV cache equals recomputing the sequence without it: the load check's oracle for bugs that are
the same at every TP size and in every prefill (positions numbered from 0 in each forward, a cache written to or
read from the wrong slots, a decode step that opens a new KV block), which neither the TP comparison nor the hooked
prefill can see.

Two comparisons on each prompt and the tokens the engine generated greedily for it, by the model at TP=1 built in
this process as a worker builds it:
- the tokens (``first_kv_mismatch``): each generated token must be what the model computes from its prefix without a
  KV cache (what the profile run and the hooked diagnosis run). One forward per sequence over the prompt and its
  generated tokens gives every step's logits at once (attention is causal: position t's logits see tokens up to t
  only). A recomputed token that differs is a finding unless its logit and the engine's token's are within rounding
  of each other (a tie).
- the log-probabilities (``first_cached_difference``): the same model, driven by the engine's own Scheduler and
  ModelRunner over a KV cache of its own (all prompts as one batch: a prefill step, then a decode step for all,
  the engine's tokens fed back), must give at every generated token the log-probabilities of the recompute within
  LOGPROB_TOLERANCE. A tiny model's greedy tokens hide most of what a cache bug does: a decode step that loses its
  own key where it opens a new block moves the logits by 0.1-0.2 and keeps every token.
The load check builds that model once (``load_check.tp1_model``, under a CudaGuard) for these oracles and the
reference oracle.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pytest_enginecheck.targets.engine_ref.tiny_engine import BLOCK_SIZE, MAX_MODEL_LEN

TIE_RTOL = 1e-4  # of the largest |logit|: two tokens this close may swap between the cached and uncached paths
# The cached and uncached paths of a correct float32 model differ by summation order only: measured on the bundled
# zoo's tiny checkpoints (the load check's detail ``kv_max_logprob_difference``) at most 3.4e-6 in log-probability
# (Mixtral, Qwen3-MoE). The tolerance is 29x that, and 2,000x below what the planted decode bug at a block boundary
# gives (tests/plugin_zoo/zoo/planted_inputs.py: 0.20).
LOGPROB_TOLERANCE = 1e-4


def engine_config(ckpt: Path, seed: int) -> Any:
    """The EngineConfig of a TP=1 engine on ``ckpt`` as the tiny engine starts it (max_model_len, block size)."""
    from engine_ref.engine.arg_utils import EngineArgs

    return EngineArgs(model=str(ckpt), device_memory="1GiB", max_model_len=MAX_MODEL_LEN, block_size=BLOCK_SIZE,
                      distributed_executor_backend="uni", seed=seed).create_engine_config(inspect_in_subprocess=False)


def load_tp1(spec: str, ckpt: Path, seed: int, guard: Any) -> Any:
    """The architecture's model at TP=1 on CPU, built and loaded as a worker does (no process group needed), under
    ``guard`` (a CudaGuard: what the build does with CUDA is recorded)."""
    import torch

    from engine_ref.model_executor.model_loader.loaders import get_model_loader
    from pytest_enginecheck.guard import CudaAccessError
    from pytest_enginecheck.targets.engine_ref.registry import engine_ref_registry

    engine_ref_registry(spec)
    config = engine_config(ckpt, seed)
    torch.manual_seed(seed)
    with guard:
        try:
            return get_model_loader(config.load_config).load_model(config, torch.device("cpu"))
        except CudaAccessError:  # recorded in guard.accesses; reported by the caller
            return None


def recomputed_logits(model: Any, prompt: list[int], generated: list[int]) -> Any:
    """The logits of each step of ``generated`` (``[len(generated), vocab]``), from one forward over the prompt and the
    tokens generated before the last, without a KV cache."""
    import torch

    from engine_ref.model_executor.forward_context import AttentionMetadata, set_forward_context

    tokens = prompt + generated[:-1]
    input_ids = torch.tensor(tokens, dtype=torch.long)
    with set_forward_context(AttentionMetadata(query_start_loc=[0, len(tokens)], seq_lens=[len(tokens)])):
        hidden_states = model(input_ids, torch.arange(len(tokens)))
    return model.compute_logits(hidden_states[len(prompt) - 1:]).float()


def first_kv_mismatch(model: Any, prompts: list[list[int]], outputs: list[list[int]]) -> dict[str, Any] | None:
    """None when every generated token of ``outputs`` is what ``model`` (``load_tp1``'s) recomputes from its prefix
    without the KV cache (or ties with it); else the first that is not: prompt, step, the engine's and the recomputed
    token, and how far apart their logits are."""
    for i, (prompt, generated) in enumerate(zip(prompts, outputs, strict=True)):
        if not generated:
            continue
        all_logits = recomputed_logits(model, prompt, generated)
        for step, token in enumerate(generated):
            logits = all_logits[step]
            recomputed = int(logits.argmax())
            gap = float(logits[recomputed] - logits[token])
            if recomputed != token and gap > TIE_RTOL * max(1.0, float(logits.abs().max())):
                return {"prompt": i, "step": step, "engine": token, "recomputed": recomputed, "logit_gap": gap}
    return None


def cached_logits(model: Any, config: Any, prompts: list[list[int]], outputs: list[list[int]]) -> list[Any]:
    """Each generated step's logits (per prompt ``[len(generated), vocab]``) when the engine's Scheduler and
    ModelRunner run ``model`` over a KV cache of their own on ``prompts``, feeding back the engine's ``outputs``."""
    import torch

    from engine_ref.engine.scheduler import Request, Scheduler
    from engine_ref.kv_cache.block_pool import BlockPool
    from engine_ref.model_executor.layers.attention import Attention
    from engine_ref.utils import cdiv
    from engine_ref.worker.model_runner import ModelRunner

    block_size, scheduler_config = config.cache_config.block_size, config.scheduler_config
    num_blocks = sum(cdiv(len(p) + len(g), block_size) for p, g in zip(prompts, outputs, strict=True))
    layers = [m for m in model.modules() if isinstance(m, Attention)]
    hidden: list[Any] = []
    hook = model.register_forward_hook(lambda module, args, output: hidden.append(output))
    for attn in layers:
        attn.kv_cache = torch.zeros(2, num_blocks, block_size, attn.num_kv_heads, attn.head_size,
                                    dtype=config.model_config.torch_dtype)
    rows: list[list[Any]] = [[] for _ in prompts]
    try:
        scheduler = Scheduler(BlockPool(num_blocks, block_size), scheduler_config.max_num_batched_tokens,
                              scheduler_config.max_num_seqs, config.model_config.max_model_len)
        for i, (prompt, generated) in enumerate(zip(prompts, outputs, strict=True)):
            scheduler.add_request(Request(i, list(prompt), len(generated)))
        runner = ModelRunner(model, config, torch.device("cpu"))
        while scheduler.has_unfinished_requests():
            output = scheduler.schedule()
            hidden.clear()
            runner.execute_model(output)
            last = torch.tensor([len(s.token_ids) for s in output.seqs]).cumsum(0) - 1
            logits = model.compute_logits(hidden[-1][last]).float()
            for row, seq in zip(logits, output.seqs, strict=True):
                rows[seq.request_id].append(row)
            scheduler.update_from_output(
                output, [outputs[s.request_id][len(rows[s.request_id]) - 1] for s in output.seqs])
    finally:
        hook.remove()
        for attn in layers:
            attn.kv_cache = None
    return [torch.stack(r) if r else torch.empty(0) for r in rows]


def first_cached_difference(model: Any, config: Any, prompts: list[list[int]], outputs: list[list[int]]
                            ) -> tuple[dict[str, Any] | None, float]:
    """The first generated step whose log-probabilities with the KV cache (``cached_logits``) differ from the
    recompute's by more than LOGPROB_TOLERANCE (prompt, step, difference; None when none does), and the largest
    difference over every step."""
    import torch

    cached = cached_logits(model, config, prompts, outputs)
    first, largest = None, 0.0
    for i, (prompt, generated) in enumerate(zip(prompts, outputs, strict=True)):
        if not generated:
            continue
        ours = torch.log_softmax(cached[i], dim=-1)
        recomputed = torch.log_softmax(recomputed_logits(model, prompt, generated), dim=-1)
        per_step = (ours - recomputed).abs().amax(dim=-1)
        largest = max(largest, float(per_step.max()))
        over = (per_step > LOGPROB_TOLERANCE).nonzero()
        if first is None and len(over):
            step = int(over[0, 0])
            first = {"prompt": i, "step": step, "difference": float(per_step[step])}
    return first, largest


def _where(prompts: list[list[int]], i: int, step: int) -> str:
    """Prompt ``i``'s generated token ``step`` in words: the step, and where its input token sits in the KV cache."""
    length = len(prompts[i])
    if step == 0:
        return (f"for prompt {i} ({length} tokens), its first token (the prefill, whose attention reads the cache it "
                f"just wrote)")
    position = length + step - 1
    block, offset = divmod(position, BLOCK_SIZE)
    opens = ", the first slot of a new block" if offset == 0 else ""
    return (f"for prompt {i} ({length} tokens), its token {step} (decode step {step}, its input token at position "
            f"{position}: KV block {block}, slot {offset} of {BLOCK_SIZE}{opens}; the steps before it agree)")


def describe(architecture: str, mismatch: dict[str, Any], prompts: list[list[int]]) -> str:
    """The finding in words (``first_kv_mismatch``'s or ``first_cached_difference``'s): where decoding with the KV
    cache left the recomputed sequence, and where to look."""
    where = _where(prompts, mismatch["prompt"], mismatch["step"])
    if "difference" in mismatch:
        what = (f"{architecture} computes other log-probabilities with the KV cache than recomputing without it, at "
                f"tensor_parallel_size=1 (the engine's scheduler and model runner feeding back its tokens): {where} "
                f"differs by {mismatch['difference']:.3g} in log-probability, above the tolerance "
                f"{LOGPROB_TOLERANCE:g}, although the generated tokens agree.")
    else:
        what = (f"{architecture} generates different tokens with the KV cache than recomputing without it, at "
                f"tensor_parallel_size=1: {where} is {mismatch['engine']} with the KV cache and "
                f"{mismatch['recomputed']} when the prompt and the tokens before it are run again in one forward "
                f"without the cache (its logit is higher by {mismatch['logit_gap']:.3g}).")
    return (f"{what} The hooked prefill and the TP comparison cannot see this (it is the same at every TP size). Hint: "
            f"check what a layer this model changed does with ``positions`` (numbered per forward instead of per "
            f"sequence?) and with the KV cache (slot_mapping, block_tables, seq_lens) in decode.")
