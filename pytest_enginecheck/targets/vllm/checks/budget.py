"""budget[tp=N] on vLLM: each rank's weights, buffers, activation peak and one request's KV fit the budget, at
startup and while it serves requests, and nothing grows from one round of requests to the next.

The engine start (shared with load) runs, after its own generation, the workload of ``engine/workload.py``: the fixed
prompts as one batch, twice, every rank measuring its prefill and decode steps. Then, per rank:
- startup: weights + buffers + the profile run's activation peak + one request's KV fit the budget;
- each step phase: weights + buffers + one request's KV + the phase's peak (what the step allocated and what earlier
  steps still held) fit the budget, and the peak is no larger than the profile run's (beyond ``profile_slack``):
  vLLM reserves only the profile run's peak for activations and gives the rest of the GPU to the KV cache, so a step
  that needs more runs out of memory once the KV cache fills, however large the GPU;
- what the steps hold after the second round beyond what they held after the first is a per-request leak (the KV
  cache is allocated at startup and written in place, so it is not that); at TP > 1 beyond one collective's tensor,
  which gloo may free a moment late (the detail's ``leak_tolerance``). Judged before the peaks: what grows names the
  bug better than the peak it causes.

With --enginecheck-device-memory, the full-size model (a published config.json given for the architecture) must fit
that GPU too, as vLLM's own classes and KV-cache sizing predict it (``checks/full_size.py``, ``fit/``).
"""

from __future__ import annotations

import json
import os
from typing import Any

from pytest_enginecheck.checks import CheckContext, CheckFailure
from pytest_enginecheck.targets.vllm.checks.steps import apart, engine_inputs, shared_run, verify_tp
from pytest_enginecheck.targets.vllm.engine.drive import EngineRun

# How much more than the profile run a step may allocate before it is called a step the KV cache sizing did not
# reserve: vLLM's per-step bookkeeping and a chunked prefill's state, which a dummy run sizes a little differently
# (measured on tiny Llama, Mixtral, Qwen3-MoE, DeepSeek-V2, Gemma-2, Phi-3, Mamba-2: at most Mamba-2's prefill,
# 21 KB over its profile run). Of the profile run's peak, or at least PROFILE_SLACK_MIN bytes.
PROFILE_SLACK, PROFILE_SLACK_MIN = 0.125, 1 << 20


def profile_slack(activation_peak: int) -> int:
    """How many bytes beyond the profile run's ``activation_peak`` a step may allocate."""
    return max(PROFILE_SLACK_MIN, int(activation_peak * PROFILE_SLACK))


def run_budget(ctx: CheckContext, mode: str = "warm") -> dict[str, Any]:
    """budget[tp=N]: each rank fits the budget at startup and while serving requests, and keeps nothing per request."""
    from engine_ref.utils import format_bytes, parse_size

    ckpt, args = apart(ctx, engine_inputs)
    verify_tp(ckpt, ctx.tp)
    budget = ctx.options.budget_memory  # --enginecheck-budget-memory: each rank's device size
    run = shared_run(ctx, ckpt, ctx.tp, mode, args)
    limit = parse_size(budget)
    over = [m for m in run.memory if m["needs"] > limit]
    detail: dict[str, Any] = {
        "tensor_parallel_size": ctx.tp, "dtype": args["dtype"], "budget": budget, "memory_per_rank": run.memory,
        "counted": "needs = weights + buffers + activation_peak + kv_one_request (kv_cache_allocated is what vLLM "
                   "allocated from VLLM_CPU_KVCACHE_SPACE, not what the model needs)"}
    if over:
        raise CheckFailure(f"{ctx.architecture} at tensor_parallel_size={ctx.tp} ({args['dtype']}): " + "; ".join(
            f"rank {m['rank']} needs {format_bytes(m['needs'])} (weights {format_bytes(m['weights'])}, activations "
            f"{format_bytes(m['activation_peak'])}, KV {format_bytes(m['kv_one_request'])} for one request of "
            f"max_model_len, buffers {format_bytes(m['buffers'])}) but the budget is {budget}" for m in over),
            {**detail, "kind": "budget"})
    if ctx.options.device_memory:  # --enginecheck-device-memory: the full-size model fits that GPU too
        from pytest_enginecheck.targets.vllm.checks.full_size import full_size_fit

        detail["full_size"] = full_size_fit(ctx)
    if not run.workload:
        return {**detail, "workload": "not run"}
    tolerance = _late_release_bytes(ckpt, ctx.tp, args["dtype"])
    detail.update(workload_per_rank=run.workload[-1], leak_tolerance=tolerance,
                  held_per_round=[[rank["held"] for rank in ranks] for ranks in run.workload])
    where = f"{ctx.architecture} at tensor_parallel_size={ctx.tp} ({args['dtype']})"
    leaks = per_request_leaks(run, tolerance)
    if leaks:
        raise CheckFailure(
            f"{where} keeps memory from one request to the next: {'; '.join(leaks)}. Both rounds ran the same "
            f"requests, so a tensor a step created outlives it (kept on a module, in a list or a cache that grows with "
            f"every call): free it, or reuse one buffer.", {**detail, "kind": "per_request_leak"})
    violations = workload_violations(run, limit)
    if violations:
        raise CheckFailure(
            f"{where} fits the budget at startup but not while serving requests: {'; '.join(violations)}. vLLM "
            f"reserves its profile run's activation peak (one dummy step of max_num_batched_tokens tokens) and gives "
            f"the rest of the device to the KV cache, so a step that allocates more runs out of memory once the KV "
            f"cache is full: allocate no more in prefill or decode steps than the profile run does (or make the "
            f"profile run allocate it too).", {**detail, "kind": "workload"})
    return detail


def workload_violations(run: EngineRun, budget: int) -> list[str]:
    """One sentence per rank and step phase of the last round whose peak exceeds the budget (with the rank's weights,
    buffers and one request's KV) or the profile run's activation peak (beyond ``profile_slack``)."""
    from engine_ref.utils import format_bytes

    memory = {m["rank"]: m for m in run.memory}
    sentences = []
    for rank in run.workload[-1]:
        m = memory[rank["rank"]]
        static = m["weights"] + m["buffers"] + m["kv_one_request"]
        for phase, peak in rank["peaks"].items():
            needs = static + peak["total"]
            if needs <= budget and peak["total"] <= m["activation_peak"] + profile_slack(m["activation_peak"]):
                continue
            reserved = format_bytes(m["activation_peak"])
            over = (f"the budget is {format_bytes(budget)}" if needs > budget else
                    f"the profile run, all vLLM reserves for activations, measured {reserved}")
            sentences.append(
                f"rank {rank['rank']} needs {format_bytes(needs)} in {phase} steps (activations "
                f"{format_bytes(peak['activations'])} and {format_bytes(peak['held'])} held from earlier steps, "
                f"where the profile run measured {format_bytes(m['activation_peak'])}; weights "
                f"{format_bytes(m['weights'])}, KV {format_bytes(m['kv_one_request'])} for one request of "
                f"max_model_len, buffers {format_bytes(m['buffers'])}) but {over}")
    return sentences


def per_request_leaks(run: EngineRun, tolerance: int) -> list[str]:
    """One sentence per rank whose steps hold more than ``tolerance`` bytes more after the last round than after the
    first."""
    from engine_ref.utils import format_bytes

    sentences = []
    for before, after in zip(run.workload[0], run.workload[-1], strict=True):
        growth = after["held"] - before["held"]
        steps = after["steps"] - before["steps"]
        if growth > tolerance:
            sentences.append(
                f"rank {after['rank']} holds {format_bytes(growth)} more after the second round than after the first "
                f"({format_bytes(growth // max(1, steps))} per step over its {steps} steps), not KV cache")
    return sentences


def _late_release_bytes(ckpt: str, tp: int, dtype: str) -> int:
    """At TP > 1, the largest tensor a step moves through a collective (every prompt token's hidden state or logits),
    which gloo may drop a moment after the step returned; 0 at TP=1."""
    from pytest_enginecheck.targets.vllm.engine.drive import checkpoint_prompts

    if tp == 1:
        return 0
    with open(os.path.join(ckpt, "config.json")) as f:
        config = json.load(f)
    text = config.get("text_config", config)
    width = max(int(text.get("hidden_size", 0)), int(text.get("vocab_size", 0)))
    itemsize = 2 if dtype in ("bfloat16", "float16") else 4
    return sum(map(len, checkpoint_prompts(ckpt))) * width * max(4, itemsize)
