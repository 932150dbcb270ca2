"""The budget check's workload on vLLM: the same requests twice, each rank measuring the steps it runs.

vLLM sizes a GPU's KV cache from what its profile run left (``determine_available_memory``: one dummy step of
``max_num_batched_tokens`` tokens and a dummy sampler run), so a step that allocates more than that run did has no
room once the KV cache fills, and a step that keeps what it allocated grows with every request. Neither shows at
startup. So, after the checks' own generation, every rank wraps its model runner's ``execute_model`` and
``sample_tokens`` in engine_ref's StepMemoryTracker (the tracker engine_ref's workers use: storages created inside a
step, counted until their last reference dies) and the engine runs ``ROUNDS`` rounds of the fixed prompts as one
batch: greedy, ``MAX_TOKENS`` tokens, no log-probabilities (what the profile run sizes is a plain step). After each
round every rank reports its phases' peaks and what its steps still hold.

A step is a ``prefill`` when some request in it is scheduled more than one token, else a ``decode``; the sampling
that follows a forward pass is measured as a part of its step.
"""

from __future__ import annotations

from typing import Any

ROUNDS = 2
TRACKER = "_enginecheck_step_memory"  # the model runner's attribute holding its StepMemoryTracker


def _phase(scheduler_output: Any) -> str:
    scheduled = getattr(scheduler_output, "num_scheduled_tokens", None) or {}
    return "prefill" if any(n > 1 for n in scheduled.values()) else "decode"


def track_steps(worker: Any) -> None:
    """Run on every worker (``collective_rpc``): from now on each of its model runner's steps is measured."""
    from engine_ref.memory.workload import StepMemoryTracker
    from pytest_enginecheck.targets.vllm.engine.memory import existing_storages

    runner = worker.model_runner
    tracker = StepMemoryTracker(runner.device, existing_storages(runner))
    setattr(runner, TRACKER, tracker)
    current = ["prefill"]
    execute = runner.execute_model

    def execute_model(scheduler_output: Any, *args: Any, **kwargs: Any) -> Any:
        if not getattr(scheduler_output, "total_num_scheduled_tokens", 1):
            return execute(scheduler_output, *args, **kwargs)
        current[0] = _phase(scheduler_output)
        return tracker.step(current[0], lambda: execute(scheduler_output, *args, **kwargs))

    runner.execute_model = execute_model
    sample = getattr(runner, "sample_tokens", None)
    if sample is not None:  # vLLM >= 0.11 samples in a call of its own after execute_model
        def sample_tokens(*args: Any, **kwargs: Any) -> Any:
            return tracker.step(current[0], lambda: sample(*args, **kwargs), count=False)

        runner.sample_tokens = sample_tokens


def step_memory(worker: Any) -> dict[str, Any]:
    """Run on every worker (``collective_rpc``): its rank and its WorkloadMemory so far, as a dict."""
    tracker = getattr(worker.model_runner, TRACKER)
    return {"rank": worker.rank, **tracker.report().to_dict()}


def run_workload(llm: Any, prompts: list[list[int]], max_tokens: int) -> list[list[dict[str, Any]]]:
    """``ROUNDS`` rounds of ``prompts`` as one batch under every rank's step tracking; per round, each rank's
    ``step_memory`` (this process's ranks: one, or all of them in vLLM's own layout)."""
    from pytest_enginecheck.targets.vllm.probe import engine_api

    params = engine_api().sampling_params(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    llm.collective_rpc(track_steps)
    rounds = []
    for _ in range(ROUNDS):
        llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        rounds.append(list(llm.collective_rpc(step_memory)))
    return rounds
