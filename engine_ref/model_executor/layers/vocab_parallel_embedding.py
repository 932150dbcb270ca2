"""Vocab-parallel embedding and LM head: each rank holds a contiguous block of vocabulary rows.

The vocabulary is padded to a multiple of the TP size so every rank holds the same number of
rows (the padding rows are zero and never produce a real token).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine_ref.distributed.parallel_state import get_tp_group
from engine_ref.model_executor.model_loader.weight_utils import (
    CheckpointTensor,
    check_shape,
    checkpoint_shapes,
    copy_into,
    set_weight_attrs,
)
from engine_ref.utils import cdiv


class VocabParallelEmbedding(nn.Module):
    """Token embedding whose rows are split over ranks; lookups are summed over ranks."""

    def __init__(self, num_embeddings: int, embedding_dim: int) -> None:
        super().__init__()
        tp = get_tp_group()
        self.tp_rank, self.tp_size = tp.rank_in_group, tp.world_size
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.num_embeddings_per_partition = cdiv(num_embeddings, self.tp_size)
        self.vocab_start_index = self.tp_rank * self.num_embeddings_per_partition
        self.vocab_end_index = min(self.vocab_start_index + self.num_embeddings_per_partition, num_embeddings)
        self.weight = nn.Parameter(torch.empty(self.num_embeddings_per_partition, embedding_dim),
                                   requires_grad=False)
        set_weight_attrs(self.weight, output_dim=0, weight_loader=self.weight_loader,
                         checkpoint_shapes={None: (num_embeddings, embedding_dim)})

    def weight_loader(self, param: nn.Parameter, loaded: CheckpointTensor) -> None:
        check_shape(loaded.name, loaded, checkpoint_shapes(param)[None])
        rows = max(0, self.vocab_end_index - self.vocab_start_index)
        if rows:
            copy_into(param.data[:rows], loaded.narrow(0, self.vocab_start_index, rows).load(), loaded.name)
        else:  # every row of this rank is padding past the vocabulary: it needs none of the tensor
            loaded.mark_consumed()
        param.data[rows:].zero_()

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        in_shard = (input_ids >= self.vocab_start_index) & (input_ids < self.vocab_end_index)
        local_ids = (input_ids - self.vocab_start_index).masked_fill(~in_shard, 0)
        embeddings = F.embedding(local_ids, self.weight).masked_fill(~in_shard.unsqueeze(-1), 0)
        return get_tp_group().all_reduce(embeddings)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """Logits over the whole vocabulary (float32): local shard, gathered over ranks."""
        logits = F.linear(hidden_states, self.weight)
        logits = get_tp_group().all_gather(logits, dim=-1)
        return logits[..., : self.num_embeddings].float()


class ParallelLMHead(VocabParallelEmbedding):
    """The output projection, split over ranks like the embedding (and possibly tied to it)."""
