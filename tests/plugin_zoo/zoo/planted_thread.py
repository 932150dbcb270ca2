"""Planted for the startup check: layer 1 (not layer 0) starts a non-daemon poller thread when it is built
and never stops it, so the process that built the model cannot exit by itself after the engine shut down."""

from __future__ import annotations

import threading
import time
from typing import ClassVar

from engine_ref.config import HFConfig
from engine_ref.model_executor.layers.quantization.base_config import QuantizationConfig
from engine_ref.model_executor.models.llama import LlamaDecoderLayer, LlamaForCausalLM


def poll_kv_stats(layer_idx: int) -> None:
    """The bug's thread: polls forever, and nothing asks it to stop."""
    while True:
        time.sleep(0.05)


class PollerDecoderLayer(LlamaDecoderLayer):
    """Layer 1 starts ``kv-stats-poller-1`` (non-daemon) in ``__init__``; every other layer is Llama's."""

    def __init__(self, config: HFConfig, layer_idx: int, quant_config: QuantizationConfig | None = None,
                 prefix: str = "") -> None:
        super().__init__(config, layer_idx, quant_config, prefix)
        if layer_idx == 1:
            threading.Thread(target=poll_kv_stats, args=(layer_idx,), name=f"kv-stats-poller-{layer_idx}").start()


class PollerThreadLlamaForCausalLM(LlamaForCausalLM):
    decoder_layer_cls = PollerDecoderLayer
    example_config: ClassVar[dict] = {**LlamaForCausalLM.example_config,
                                      "architectures": ["PollerThreadLlamaForCausalLM"]}
