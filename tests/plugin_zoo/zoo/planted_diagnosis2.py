"""Planted bugs whose verdict was right but whose pointer was wrong (issue 32 item 4), each beside its clean twin.

- TpNoiseLlamaForCausalLM: layer 1's MLP adds noise from a generator no seed reaches, only at TP>1. TP=1 is
  deterministic, so TP=2 disagrees with it; blamed on "a missing or extra collective" until TP=2 was rerun.
  Twin: TpDropoutLlamaForCausalLM draws from such a generator at TP>1 too, for a dropout mask with p=0.
- LogitsShardLlamaForCausalLM: compute_logits reverses rank 1's vocabulary shard before the gather; named no
  module while compute_logits was not hooked. Twin: OwnLogitsLlamaForCausalLM, the same compute_logits, right.
- NoisyOutputLlamaForCausalLM: the model's forward adds seeded noise to its output after its last submodule;
  said to "arise in decoding with the KV cache" while the model's own output was not compared. Twin:
  ZeroNoiseOutputLlamaForCausalLM adds the noise times zero.
- UnguardedRankLlamaForCausalLM and GuardedRankLlamaForCausalLM (two clean models): layer 1 asks
  torch.distributed for its rank at TP>1 while it is built (unguarded; or only when a process group exists) and
  holds a scratch buffer of rank + 1 rows. Both work in the engine; the budget estimate, which builds every rank
  in one process, failed the first (no process group) and mis-sized rank 1 of the second.
"""

from __future__ import annotations

from typing import ClassVar

import torch
import torch.distributed as dist
import torch.nn.functional as F

from engine_ref.config import HFConfig
from engine_ref.distributed.parallel_state import get_tp_group
from engine_ref.model_executor.layers.quantization.base_config import QuantizationConfig
from engine_ref.model_executor.models.llama import LlamaDecoderLayer, LlamaForCausalLM, LlamaMLP
from zoo.planted_redteam import Layer1MLPLayer


def _example(name: str) -> dict:
    return {**LlamaForCausalLM.example_config, "architectures": [name]}


def _unseeded() -> torch.Generator:
    """A generator seeded from the operating system's entropy: another stream every run, whatever torch's seed."""
    generator = torch.Generator()
    generator.seed()
    return generator


class TpNoiseMLP(LlamaMLP):
    """The bug: at TP>1 its output gets noise no seed reproduces (a debugging leftover on the sharded path)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = super().forward(x)
        if get_tp_group().world_size == 1:
            return out
        return out + torch.randn(out.shape, generator=_unseeded(), dtype=out.dtype)


class TpDropoutMLP(LlamaMLP):
    """The twin: at TP>1 a dropout mask with p=0 from an unseeded generator (every element kept)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = super().forward(x)
        if get_tp_group().world_size == 1:
            return out
        return out * (torch.rand(out.shape, generator=_unseeded()) >= 0.0)


class TpNoiseDecoderLayer(Layer1MLPLayer):
    mlp_cls = TpNoiseMLP


class TpDropoutDecoderLayer(Layer1MLPLayer):
    mlp_cls = TpDropoutMLP


class TpNoiseLlamaForCausalLM(LlamaForCausalLM):
    decoder_layer_cls = TpNoiseDecoderLayer
    example_config: ClassVar[dict] = _example("TpNoiseLlamaForCausalLM")


class TpDropoutLlamaForCausalLM(LlamaForCausalLM):
    decoder_layer_cls = TpDropoutDecoderLayer
    example_config: ClassVar[dict] = _example("TpDropoutLlamaForCausalLM")


class OwnLogitsLlamaForCausalLM(LlamaForCausalLM):
    """The twin: its own compute_logits, each rank's vocabulary shard gathered in rank order."""

    example_config: ClassVar[dict] = _example("OwnLogitsLlamaForCausalLM")

    def shard_logits(self, logits: torch.Tensor) -> torch.Tensor:
        return logits

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        logits = self.shard_logits(F.linear(hidden_states, self.lm_head.weight))
        return get_tp_group().all_gather(logits, dim=-1)[..., :self.config.vocab_size].float()


class LogitsShardLlamaForCausalLM(OwnLogitsLlamaForCausalLM):
    """The bug: rank 1 reverses its vocabulary shard of the logits before the gather."""

    example_config: ClassVar[dict] = _example("LogitsShardLlamaForCausalLM")

    def shard_logits(self, logits: torch.Tensor) -> torch.Tensor:
        return logits.flip(-1) if get_tp_group().rank_in_group == 1 else logits


class ZeroNoiseOutputLlamaForCausalLM(LlamaForCausalLM):
    """The twin: seeded noise times ``noise_scale`` (zero) on the model's output, after its last submodule."""

    example_config: ClassVar[dict] = _example("ZeroNoiseOutputLlamaForCausalLM")
    noise_scale: ClassVar[float] = 0.0

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        hidden_states = super().forward(input_ids, positions, inputs_embeds)
        return hidden_states + self.noise_scale * torch.randn_like(hidden_states)


class NoisyOutputLlamaForCausalLM(ZeroNoiseOutputLlamaForCausalLM):
    """The bug: the noise is not scaled away."""

    example_config: ClassVar[dict] = _example("NoisyOutputLlamaForCausalLM")
    noise_scale: ClassVar[float] = 1.0


class _RankScratchLayer(LlamaDecoderLayer):
    """Layer 1 holds a scratch buffer of ``rank() + 1`` rows, asking for its rank only at TP>1."""

    def __init__(self, config: HFConfig, layer_idx: int, quant_config: QuantizationConfig | None = None,
                 prefix: str = "") -> None:
        super().__init__(config, layer_idx, quant_config, prefix)
        if layer_idx == 1:
            rank = self.rank() if get_tp_group().world_size > 1 else 0
            self.register_buffer("scratch", torch.zeros(rank + 1, config.hidden_size), persistent=False)

    def rank(self) -> int:
        return dist.get_rank()  # unguarded: a worker at TP>1 has joined its process group


class _GuardedRankScratchLayer(_RankScratchLayer):
    def rank(self) -> int:
        return dist.get_rank() if dist.is_initialized() else 0


class UnguardedRankLlamaForCausalLM(LlamaForCausalLM):
    decoder_layer_cls = _RankScratchLayer
    example_config: ClassVar[dict] = _example("UnguardedRankLlamaForCausalLM")


class GuardedRankLlamaForCausalLM(LlamaForCausalLM):
    decoder_layer_cls = _GuardedRankScratchLayer
    example_config: ClassVar[dict] = _example("GuardedRankLlamaForCausalLM")
