"""Red-team planted bugs for issue 17: one bug per model, each in layer 1 (not layer 0) of the tiny 2-layer Llama
and away from the first check that runs (import), of kinds model authors ship. Each class docstring says the bug
and the check that must catch it; zoo/planted.py registers the ones that add coverage."""

from __future__ import annotations

import contextlib
import os
import tempfile
import threading
import time
from collections.abc import Iterable
from typing import ClassVar

import torch
from torch import nn

from engine_ref.config import HFConfig
from engine_ref.distributed.parallel_state import get_tp_group
from engine_ref.errors import WeightLoadError
from engine_ref.model_executor.layers.linear import RowParallelLinear
from engine_ref.model_executor.layers.quantization.base_config import QuantizationConfig
from engine_ref.model_executor.model_loader.weight_utils import CheckpointTensor, WeightsMapper, load_mapped_weights
from engine_ref.model_executor.models.llama import (
    STACKED_PARAMS_MAPPING,
    LlamaAttention,
    LlamaDecoderLayer,
    LlamaForCausalLM,
    LlamaMLP,
)


def _example(name: str) -> dict:
    return {**LlamaForCausalLM.example_config, "architectures": [name]}


class Layer1MLPLayer(LlamaDecoderLayer):
    """A decoder layer whose layer 1 gets ``mlp_cls`` instead of Llama's MLP."""

    mlp_cls: ClassVar[type[LlamaMLP]] = LlamaMLP

    def make_mlp(self, config: HFConfig, layer_idx: int) -> nn.Module:
        if layer_idx != 1:
            return super().make_mlp(config, layer_idx)
        return self.mlp_cls(config.hidden_size, config.intermediate_size, config.get("hidden_act", "silu"),
                            bias=config.get("mlp_bias", False), quant_config=self.quant_config,
                            prefix=f"{self.prefix}.mlp")


# 1. load (KV cache): layer 1's attention numbers the tokens of each forward from 0, so a decode step (one token at
# position n) rotates as position 0. Prefill-only recompute and every TP size agree; only decode with the KV cache
# differs from recomputing the whole sequence.
class ArangePositionsAttention(LlamaAttention):
    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        return super().forward(torch.arange(positions.shape[0], device=positions.device), hidden_states)


class ArangePositionsDecoderLayer(LlamaDecoderLayer):
    def __init__(self, config: HFConfig, layer_idx: int, quant_config: QuantizationConfig | None = None,
                 prefix: str = "") -> None:
        super().__init__(config, layer_idx, quant_config, prefix)
        if layer_idx == 1:
            bias = config.get("attention_bias", False)
            self.self_attn = ArangePositionsAttention(config, qkv_bias=bias, o_bias=bias, qk_norm=False,
                                                      quant_config=quant_config, prefix=f"{prefix}.self_attn")


class DecodePositionsLlamaForCausalLM(LlamaForCausalLM):
    """Bug: layer 1 ignores ``positions`` (arange per forward). Must be caught by: load (decode vs recompute)."""

    decoder_layer_cls = ArangePositionsDecoderLayer
    example_config: ClassVar[dict] = _example("DecodePositionsLlamaForCausalLM")


# 2. load: the model's own load_weights drops layer 1's down_proj (a stale "fused elsewhere" rule) and reports
# every parameter as loaded; the weight keeps its torch.empty init.
class SkippedWeightLlamaForCausalLM(LlamaForCausalLM):
    """Bug: layer 1's down_proj.weight silently not loaded. Must be caught by: load."""

    example_config: ClassVar[dict] = _example("SkippedWeightLlamaForCausalLM")

    def make_weights_mapper(self, config: HFConfig) -> WeightsMapper:
        return WeightsMapper(mapping=STACKED_PARAMS_MAPPING, skip=("rotary_emb.inv_freq",))

    def load_weights(self, weights: Iterable[tuple[str, CheckpointTensor]]) -> set[str]:
        skipped = "model.layers.1.mlp.down_proj.weight"
        params = dict(self.named_parameters())
        kept = [(n, t) for n, t in weights if n != skipped]
        with contextlib.suppress(WeightLoadError):  # the bug: "missing" is taken to mean "fused elsewhere"
            load_mapped_weights(self, kept, self.weights_mapper)
        return set(params)


# 3. budget: layer 1's MLP allocates (and fills) a 768 MiB scratch buffer in every forward.
class HugeScratchMLP(LlamaMLP):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scratch = torch.zeros(192 * 1024 * 1024, dtype=torch.float32, device=x.device)
        out = super().forward(x)
        return out + scratch[:1] * 0


class HugeScratchDecoderLayer(Layer1MLPLayer):
    mlp_cls = HugeScratchMLP


class HugeScratchLlamaForCausalLM(LlamaForCausalLM):
    """Bug: a 768 MiB temporary in layer 1's forward. Must be caught by: budget."""

    decoder_layer_cls = HugeScratchDecoderLayer
    example_config: ClassVar[dict] = _example("HugeScratchLlamaForCausalLM")


# 4. budget: layer 1's MLP registers a non-persistent buffer at full size on every rank, lazily at its first
# forward (a "workspace" sized for the unsharded intermediate, 32k tokens).
class LazyWorkspaceMLP(LlamaMLP):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not hasattr(self, "workspace"):
            self.register_buffer("workspace", torch.zeros(32768, 2 * 128 * 16, device=x.device), persistent=False)
        return super().forward(x)


class LazyWorkspaceDecoderLayer(Layer1MLPLayer):
    mlp_cls = LazyWorkspaceMLP


class LazyWorkspaceLlamaForCausalLM(LlamaForCausalLM):
    """Bug: a 512 MiB non-persistent buffer registered at layer 1's first forward. Must be caught by: budget."""

    decoder_layer_cls = LazyWorkspaceDecoderLayer
    example_config: ClassVar[dict] = _example("LazyWorkspaceLlamaForCausalLM")


# 5. load[tp=2]: layer 1's down_proj all-reduces twice (its output is TP times too large at TP > 1).
class TwiceReducedRowParallelLinear(RowParallelLinear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return get_tp_group().all_reduce(super().forward(x))


class TwiceReducedMLP(LlamaMLP):
    def __init__(self, hidden_size: int, intermediate_size: int, hidden_act: str = "silu", bias: bool = False,
                 quant_config: QuantizationConfig | None = None, prefix: str = "") -> None:
        super().__init__(hidden_size, intermediate_size, hidden_act, bias, quant_config, prefix)
        self.down_proj = TwiceReducedRowParallelLinear(intermediate_size, hidden_size, bias=bias,
                                                       quant_config=quant_config, prefix=f"{prefix}.down_proj")


class TwiceReducedDecoderLayer(Layer1MLPLayer):
    mlp_cls = TwiceReducedMLP


class DoubleAllReduceLlamaForCausalLM(LlamaForCausalLM):
    """Bug: layer 1's down_proj all_reduce runs twice. Must be caught by: load[tp=2], naming its collective."""

    decoder_layer_cls = TwiceReducedDecoderLayer
    example_config: ClassVar[dict] = _example("DoubleAllReduceLlamaForCausalLM")


# 6. load[tp=2]: rank 1 of TP=2 hangs in layer 1's down_proj weight_loader (a lock it never gets).
class HangingRowParallelLinear(RowParallelLinear):
    def weight_loader(self, param: nn.Parameter, loaded: CheckpointTensor, shard_id: object = None) -> None:
        group = get_tp_group()
        if group.world_size == 2 and self.tp_rank == 1:
            while True:
                time.sleep(0.5)
        super().weight_loader(param, loaded, shard_id)


class HangingMLP(LlamaMLP):
    def __init__(self, hidden_size: int, intermediate_size: int, hidden_act: str = "silu", bias: bool = False,
                 quant_config: QuantizationConfig | None = None, prefix: str = "") -> None:
        super().__init__(hidden_size, intermediate_size, hidden_act, bias, quant_config, prefix)
        self.down_proj = HangingRowParallelLinear(intermediate_size, hidden_size, bias=bias,
                                                  quant_config=quant_config, prefix=f"{prefix}.down_proj")


class HangingDecoderLayer(Layer1MLPLayer):
    mlp_cls = HangingMLP


class HangRank1LoadLlamaForCausalLM(LlamaForCausalLM):
    """Bug: TP=2 rank 1 hangs loading layer 1. Must be caught by: load[tp=2] (a hang, naming rank 1)."""

    decoder_layer_cls = HangingDecoderLayer
    example_config: ClassVar[dict] = _example("HangRank1LoadLlamaForCausalLM")


# 7. import/inspect --enginecheck-strict: layer 1 asks torch.cuda.is_available() when built (lazily, not at import).
class CudaQueryDecoderLayer(LlamaDecoderLayer):
    def __init__(self, config: HFConfig, layer_idx: int, quant_config: QuantizationConfig | None = None,
                 prefix: str = "") -> None:
        super().__init__(config, layer_idx, quant_config, prefix)
        if layer_idx == 1:
            self.use_fused_kernel = torch.cuda.is_available()


class CudaQueryBuildLlamaForCausalLM(LlamaForCausalLM):
    """Bug: torch.cuda.is_available() when layer 1 is built. Must be caught by: strict mode (load/startup)."""

    decoder_layer_cls = CudaQueryDecoderLayer
    example_config: ClassVar[dict] = _example("CudaQueryBuildLlamaForCausalLM")


# 8. startup: layer 1's MLP starts a non-daemon stats thread at its first forward (not when built).
def _stats_loop() -> None:
    while True:
        time.sleep(0.05)


class FirstForwardThreadMLP(LlamaMLP):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not getattr(self, "_stats_started", False):
            self._stats_started = True
            threading.Thread(target=_stats_loop, name="mlp-stats-1").start()
        return super().forward(x)


class FirstForwardThreadDecoderLayer(Layer1MLPLayer):
    mlp_cls = FirstForwardThreadMLP


class FirstForwardThreadLlamaForCausalLM(LlamaForCausalLM):
    """Bug: a non-daemon thread started at layer 1's first forward. Must be caught by: startup."""

    decoder_layer_cls = FirstForwardThreadDecoderLayer
    example_config: ClassVar[dict] = _example("FirstForwardThreadLlamaForCausalLM")


# 9. startup: at TP > 1 layer 1 writes its shard layout to a temp file it never removes.
class TempFileDecoderLayer(LlamaDecoderLayer):
    def __init__(self, config: HFConfig, layer_idx: int, quant_config: QuantizationConfig | None = None,
                 prefix: str = "") -> None:
        super().__init__(config, layer_idx, quant_config, prefix)
        if layer_idx == 1 and get_tp_group().world_size > 1:
            fd, _ = tempfile.mkstemp(prefix="shard-layout-", suffix=".json")
            os.write(fd, b"{}")
            os.close(fd)


class TempFileTP2LlamaForCausalLM(LlamaForCausalLM):
    """Bug: a temp file left behind, only at TP > 1. Must be caught by: startup (it runs at the largest TP)."""

    decoder_layer_cls = TempFileDecoderLayer
    example_config: ClassVar[dict] = _example("TempFileTP2LlamaForCausalLM")


# 10. load[tp=2]: at TP > 1 the LM head is tied to the input embedding ("saves memory when sharded"), although
# config.json says tie_word_embeddings=false; its checkpoint tensor is skipped.
class TiedAtTPLlamaForCausalLM(LlamaForCausalLM):
    """Bug: lm_head tied to embed_tokens only at TP > 1. Must be caught by: load[tp=2]."""

    example_config: ClassVar[dict] = _example("TiedAtTPLlamaForCausalLM")

    def __init__(self, config: HFConfig, quant_config: QuantizationConfig | None = None) -> None:
        super().__init__(config, quant_config)
        if get_tp_group().world_size > 1:
            self.lm_head = self.model.embed_tokens
            self.weights_mapper = WeightsMapper(mapping=STACKED_PARAMS_MAPPING,
                                                skip=("rotary_emb.inv_freq", "lm_head."))


# 11. load[tp=2]: rank 1 of TP > 1 adds noise from an unseeded generator to layer 1's MLP output.
class Rank1NoiseMLP(LlamaMLP):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = super().forward(x)
        group = get_tp_group()
        if group.world_size > 1 and torch.distributed.get_rank() == 1:
            gen = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))
            out = out + torch.randn(out.shape, generator=gen, dtype=out.dtype)
        return out


class Rank1NoiseDecoderLayer(Layer1MLPLayer):
    mlp_cls = Rank1NoiseMLP


class Rank1NoiseLlamaForCausalLM(LlamaForCausalLM):
    """Bug: nondeterministic only at TP=2 (rank 1's layer 1 MLP). Must be caught by: load[tp=2]."""

    decoder_layer_cls = Rank1NoiseDecoderLayer
    example_config: ClassVar[dict] = _example("Rank1NoiseLlamaForCausalLM")
