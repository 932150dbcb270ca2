"""A small scheduler: whole-prompt prefills first, then one decode step for every running request.

A request reserves KV blocks for its prompt plus ``max_tokens`` when it is admitted, so a running
request never needs preempting. With LoRA, the running requests use at most ``max_loras`` distinct
adapters (every step runs them all, and a step holds one adapter per slot): a request with another
adapter waits until one finishes. SchedulerOutput is plain data: it travels to every worker.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import torch

from engine_ref.kv_cache.block_pool import BlockPool
from engine_ref.lora.request import LoRARequest


@dataclass
class Request:
    """One prompt being generated."""

    request_id: int
    prompt_token_ids: list[int]
    max_tokens: int
    eos_token_id: int | None = None
    pixel_values: torch.Tensor | None = None
    lora_request: LoRARequest | None = None
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        if len(self.output_token_ids) >= self.max_tokens:
            return True
        return bool(self.output_token_ids) and self.output_token_ids[-1] == self.eos_token_id


@dataclass
class ScheduledSequence:
    """One request's share of a step: its new tokens, where they start, and its KV blocks."""

    request_id: int
    token_ids: list[int]
    start_position: int
    block_table: list[int]
    pixel_values: torch.Tensor | None = None
    lora_request: LoRARequest | None = None

    @property
    def seq_len(self) -> int:
        return self.start_position + len(self.token_ids)


@dataclass
class SchedulerOutput:
    seqs: list[ScheduledSequence]

    @property
    def num_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.seqs)

    @property
    def phase(self) -> str:
        """"decode" when every sequence adds one token to those it computed before, else "prefill"."""
        return "decode" if all(s.start_position > 0 and len(s.token_ids) == 1 for s in self.seqs) else "prefill"


class Scheduler:
    """First come, first served, within the token, sequence, KV block and adapter (``max_loras``) budgets."""

    def __init__(self, block_pool: BlockPool, max_num_batched_tokens: int, max_num_seqs: int,
                 max_model_len: int, max_loras: int = 0) -> None:
        self.block_pool = block_pool
        self.max_num_batched_tokens, self.max_num_seqs = max_num_batched_tokens, max_num_seqs
        self.max_model_len, self.max_loras = max_model_len, max_loras
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []

    def add_request(self, request: Request) -> None:
        self.waiting.append(request)

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        prefills: list[Request] = []
        budget = self.max_num_batched_tokens
        loras = {r.lora_request.lora_int_id for r in self.running if r.lora_request is not None}
        while self.waiting and len(self.running) + len(prefills) < self.max_num_seqs:
            request = self.waiting[0]
            prompt_len = len(request.prompt_token_ids)
            reserve = min(prompt_len + request.max_tokens, self.max_model_len)
            lora_id = None if request.lora_request is None else request.lora_request.lora_int_id
            if lora_id is not None and lora_id not in loras and len(loras) >= self.max_loras:
                break
            if prompt_len > budget or not self.block_pool.can_allocate(request.request_id, reserve):
                break
            self.block_pool.allocate(request.request_id, reserve)
            prefills.append(self.waiting.popleft())
            budget -= prompt_len
            if lora_id is not None:
                loras.add(lora_id)
        if prefills:
            self.running.extend(prefills)
            return SchedulerOutput([
                ScheduledSequence(r.request_id, list(r.prompt_token_ids), 0,
                                  self.block_pool.block_table(r.request_id), r.pixel_values, r.lora_request)
                for r in prefills
            ])
        return SchedulerOutput([
            ScheduledSequence(r.request_id, [r.output_token_ids[-1]], r.num_computed_tokens,
                              self.block_pool.block_table(r.request_id), lora_request=r.lora_request)
            for r in self.running
        ])

    def update_from_output(self, output: SchedulerOutput, sampled: list[int]) -> list[Request]:
        """Record each sequence's sampled token; free and return the requests that finished."""
        by_id = {r.request_id: r for r in self.running}
        finished = []
        for seq, token in zip(output.seqs, sampled, strict=True):
            request = by_id[seq.request_id]
            request.num_computed_tokens += len(seq.token_ids)
            request.pixel_values = None
            request.output_token_ids.append(token)
            if request.is_finished:
                finished.append(request)
                self.block_pool.free(request.request_id)
        self.running = [r for r in self.running if not r.is_finished]
        return finished
