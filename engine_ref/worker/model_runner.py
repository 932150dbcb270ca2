"""ModelRunner: turns a SchedulerOutput into tensors, runs the model, samples greedily.

With LoRA, each batch first points the LoRA layers at the slots of its sequences' adapters.
"""

from __future__ import annotations

from typing import cast

import torch
from torch import nn

from engine_ref.config import EngineConfig
from engine_ref.engine.scheduler import ScheduledSequence, SchedulerOutput
from engine_ref.lora.models import LoRAModelManager
from engine_ref.memory.accounting import measure_peak
from engine_ref.model_executor.forward_context import AttentionMetadata, set_forward_context
from engine_ref.model_executor.models.interfaces import VllmModelForTextGeneration


class ModelRunner:
    """Runs one rank's model on scheduled batches (and the profile run that sizes the KV cache)."""

    def __init__(self, model: nn.Module, config: EngineConfig, device: torch.device,
                 lora_manager: LoRAModelManager | None = None) -> None:
        self.model, self.config, self.device = model, config, device
        self.lora_manager = lora_manager
        self.block_size = config.cache_config.block_size

    def _slots(self, seq: ScheduledSequence) -> list[int]:
        bs = self.block_size
        return [seq.block_table[p // bs] * bs + p % bs for p in range(seq.start_position, seq.seq_len)]

    def _run(self, seqs: list[ScheduledSequence], with_cache: bool) -> list[int]:
        input_ids = torch.tensor([t for s in seqs for t in s.token_ids], dtype=torch.long, device=self.device)
        positions = torch.cat([torch.arange(s.start_position, s.seq_len, device=self.device) for s in seqs])
        query_start_loc = [0]
        for s in seqs:
            query_start_loc.append(query_start_loc[-1] + len(s.token_ids))
        metadata = AttentionMetadata(query_start_loc=query_start_loc, seq_lens=[s.seq_len for s in seqs])
        if with_cache:
            metadata.slot_mapping = torch.tensor([slot for s in seqs for slot in self._slots(s)],
                                                 dtype=torch.long, device=self.device)
            metadata.block_tables = [s.block_table for s in seqs]
        kwargs = {}
        images = [s.pixel_values for s in seqs if s.pixel_values is not None]
        if images:
            kwargs["pixel_values"] = torch.cat([img.reshape(-1, *img.shape[-3:]) for img in images]).to(self.device)
        with set_forward_context(metadata):
            hidden_states = self.model(input_ids, positions, **kwargs)
        last = torch.tensor(query_start_loc[1:], device=self.device) - 1
        logits = cast(VllmModelForTextGeneration, self.model).compute_logits(hidden_states[last])
        return logits.argmax(dim=-1).tolist()

    @torch.inference_mode()
    def execute_model(self, scheduler_output: SchedulerOutput) -> list[int]:
        """One step: the next token of every scheduled sequence (greedy)."""
        seqs = scheduler_output.seqs
        if self.lora_manager is not None:
            self.lora_manager.set_active_adapters([s.lora_request for s in seqs], [len(s.token_ids) for s in seqs])
        return self._run(seqs, with_cache=True)

    def profile_seq_lens(self) -> list[int]:
        """The profile batch: max_num_batched_tokens tokens in sequences of at most max_model_len."""
        total = self.config.scheduler_config.max_num_batched_tokens
        max_len = self.config.model_config.max_model_len
        lens = [max_len] * (total // max_len)
        return [*lens, total % max_len] if total % max_len else lens

    def profile_seqs(self) -> list[ScheduledSequence]:
        """The profile batch; a multimodal model's first sequence carries one (blank) image."""
        seqs = [ScheduledSequence(i, [0] * n, 0, []) for i, n in enumerate(self.profile_seq_lens())]
        dummy_image = getattr(self.model, "dummy_image_inputs", None)
        if dummy_image is not None:
            placeholders, pixel_values = dummy_image()
            first = seqs[0]
            if len(placeholders) <= len(first.token_ids):
                first.token_ids[:len(placeholders)] = placeholders
                first.pixel_values = pixel_values
        return seqs

    @torch.inference_mode()
    def profile_run(self) -> int:
        """Run the largest batch the scheduler may send, without a KV cache; return its peak bytes.

        With LoRA, every sequence runs with an adapter, over all ``max_loras`` slots (vLLM's dummy LoRAs)."""
        seqs = self.profile_seqs()
        if self.lora_manager is not None:
            self.lora_manager.set_dummy_adapters([len(s.token_ids) for s in seqs])
        existing = [*self.model.parameters(), *self.model.buffers()]
        _, peak = measure_peak(lambda: self._run(seqs, with_cache=False), self.device, existing)
        return peak
