"""Decode with the KV cache equals recomputing the sequence without it: the load check's oracle for bugs that are
the same at every TP size and in every prefill (positions numbered from 0 in each forward, a cache written to or
read from the wrong slots), which neither the TP comparison nor the hooked prefill can see.

For each prompt and the tokens the engine generated greedily, the model (TP=1, built in this process as a worker
builds it) recomputes every generated token from the prompt and the tokens before it, in one forward without a KV
cache (what the profile run and the hooked diagnosis run). An exact oracle up to float rounding: a recomputed token
that differs is a finding unless its logit and the engine's token's are within rounding of each other (a tie).
The load check builds that model once (``load_check.tp1_model``, under a CudaGuard) for this oracle and the
reference oracle.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

TIE_RTOL = 1e-4  # of the largest |logit|: two tokens this close may swap between the cached and uncached paths


def load_tp1(spec: str, ckpt: Path, seed: int, guard: Any) -> Any:
    """The architecture's model at TP=1 on CPU, built and loaded as a worker does (no process group needed), under
    ``guard`` (a CudaGuard: what the build does with CUDA is recorded)."""
    import torch

    from engine_ref.engine.arg_utils import EngineArgs
    from engine_ref.model_executor.model_loader.loaders import get_model_loader
    from pytest_enginecheck.guard import CudaAccessError
    from pytest_enginecheck.targets.engine_ref.registry import engine_ref_registry

    engine_ref_registry(spec)
    config = EngineArgs(model=str(ckpt), device_memory="1GiB", max_model_len=128, distributed_executor_backend="uni",
                        seed=seed).create_engine_config(inspect_in_subprocess=False)
    torch.manual_seed(seed)
    with guard:
        try:
            return get_model_loader(config.load_config).load_model(config, torch.device("cpu"))
        except CudaAccessError:  # recorded in guard.accesses; reported by the caller
            return None


def _next_logits(model: Any, tokens: list[int]) -> Any:
    """The logits after ``tokens``, from one forward over all of them without a KV cache."""
    import torch

    from engine_ref.model_executor.forward_context import AttentionMetadata, set_forward_context

    input_ids = torch.tensor(tokens, dtype=torch.long)
    with set_forward_context(AttentionMetadata(query_start_loc=[0, len(tokens)], seq_lens=[len(tokens)])):
        hidden_states = model(input_ids, torch.arange(len(tokens)))
    return model.compute_logits(hidden_states[-1:])[0]


def first_kv_mismatch(model: Any, prompts: list[list[int]], outputs: list[list[int]]) -> dict[str, Any] | None:
    """None when every generated token of ``outputs`` is what ``model`` (``load_tp1``'s) recomputes from its prefix
    without the KV cache (or ties with it); else the first that is not: prompt, step, the engine's and the recomputed
    token, and how far apart their logits are."""
    for i, (prompt, generated) in enumerate(zip(prompts, outputs, strict=True)):
        for step, token in enumerate(generated):
            logits = _next_logits(model, prompt + generated[:step])
            recomputed = int(logits.argmax())
            gap = float(logits[recomputed] - logits[token])
            if recomputed != token and gap > TIE_RTOL * max(1.0, float(logits.abs().max())):
                return {"prompt": i, "step": step, "engine": token, "recomputed": recomputed, "logit_gap": gap}
    return None


def describe(architecture: str, mismatch: dict[str, Any], outputs: list[list[int]]) -> str:
    """The finding in words: where decoding with the KV cache left the recomputed sequence, and where to look."""
    i, step = mismatch["prompt"], mismatch["step"]
    where = ("its first token (the prefill, whose attention reads the cache it just wrote)" if step == 0 else
             f"its token {step} (decode step {step}; the tokens before it agree)")
    return (f"{architecture} generates different tokens with the KV cache than recomputing without it, at "
            f"tensor_parallel_size=1: for prompt {i} ({outputs[i]}), {where} is {mismatch['engine']} with the KV "
            f"cache and {mismatch['recomputed']} when the prompt and the tokens before it are run again in one "
            f"forward without the cache (its logit is higher by {mismatch['logit_gap']:.3g}). The hooked prefill "
            f"and the TP comparison cannot see this (it is the same at every TP size). Hint: check what a layer this "
            f"model changed does with ``positions`` (numbered per forward instead of per sequence?) and with the "
            f"KV cache (slot_mapping, block_tables) in decode.")
