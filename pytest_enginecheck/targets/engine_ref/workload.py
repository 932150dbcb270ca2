"""The budget check's workload on a started engine_ref LLM: the same requests twice, each rank measuring its steps.

A round is one batch of prompts of different lengths (``tiny_engine.prompts``): a prefill step, then
``MAX_TOKENS - 1`` decode steps. Each rank's worker reports its step memory (``WorkerReport.workload``, after
``Worker.track_step_memory``) at the end of each round, through the executor's ``collective_rpc``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pytest_enginecheck.targets.engine_ref.tiny_engine import prompts

ROUNDS = 2
MAX_TOKENS = 6  # a prefill and 5 decode steps


@dataclass(frozen=True)
class WorkloadRounds:
    """What each rank reported after each round (``rounds[i][rank]``: a WorkerReport with its ``workload``), and
    ``late_release_bytes``: how much a rank may still hold after a round without having kept anything (at TP > 1
    the collective backend may drop the tensor it last reduced or gathered a moment after returning; 0 at TP=1)."""

    rounds: list[list[Any]]
    late_release_bytes: int

    @property
    def final(self) -> list[Any]:
        """Each rank's report after the last round."""
        return self.rounds[-1]


def run_workload(llm: Any) -> WorkloadRounds | None:
    """Turn on every rank's step memory, run ``ROUNDS`` rounds of the same requests, read the ranks' reports;
    None when max_model_len leaves no room for a prompt and a decode step (1 token)."""
    engine = llm.engine
    model_config = engine.config.model_config
    if model_config.max_model_len < 2:
        return None
    text = model_config.hf_text_config
    max_tokens = min(MAX_TOKENS, model_config.max_model_len - 1)
    batch = [prompt[:model_config.max_model_len - max_tokens] for prompt in prompts(text.vocab_size)]
    engine.executor.collective_rpc("track_step_memory")
    rounds = []
    for _ in range(ROUNDS):
        llm.generate(batch, max_tokens=max_tokens, ignore_eos=True)
        rounds.append(engine.executor.worker_reports())
    late = 0
    if engine.config.parallel_config.tensor_parallel_size > 1:  # the largest hidden state or logits a step moves
        late = sum(map(len, batch)) * max(text.hidden_size, text.vocab_size) * max(4, model_config.torch_dtype.itemsize)
    return WorkloadRounds(rounds, late)
