"""Planted for the leftovers every engine_ref engine is checked for (pytest_enginecheck/targets/engine_ref/
leftovers.py), each in layer 1 (not layer 0) of the tiny 2-layer Llama, each beside its clean twin:

- a helper process started at the first decode step at TP > 1, never waited for (twin: one it waits for);
- a non-daemon thread started at the first decode step at TP > 1, never stopped (twin: a daemon thread it stops and
  joins at the next decode step);
- a file written at build to a fixed path in /tmp, never removed (twin: one it removes once it read it back);
- the same file as a POSIX shared-memory segment in /dev/shm (shm_open's directory), never unlinked (twin: unlinked).

The decode-time ones are invisible to a check that starts an engine without requests (the profile run and the
prefill are no decode step) or only at TP=1. The /tmp file bypasses the engine's private temp dir (tempfile's). Its
name carries ``$ZOO_LEFTOVER_TAG`` (set by the test for its session) and the building process's pid, so that a test
can remove what its own session left, and two sessions beside each other never write the same file.
"""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
import threading
import time
from typing import ClassVar

import torch

from engine_ref.config import HFConfig
from engine_ref.distributed.parallel_state import get_tp_group
from engine_ref.model_executor.forward_context import get_attn_metadata
from engine_ref.model_executor.layers.quantization.base_config import QuantizationConfig
from engine_ref.model_executor.models.llama import LlamaDecoderLayer, LlamaForCausalLM, LlamaMLP
from zoo.planted_redteam import Layer1MLPLayer

TAG_VARIABLE = "ZOO_LEFTOVER_TAG"
HELPER = "import time; time.sleep(60)  # zoo leftover helper"


def layout_path(directory: str = "/tmp") -> str:
    """The fixed path in ``directory`` a build writes its shard layout to (with this session's tag and this process's
    pid)."""
    return f"{directory}/zoo-shard-layout-{os.environ.get(TAG_VARIABLE, 'untagged')}-{os.getpid()}.json"


def decoding_at_tp() -> bool:
    """Whether this forward is a decode step (every sequence's one new token, after its prompt) of a TP > 1 engine."""
    if get_tp_group().world_size < 2:
        return False
    try:
        metadata = get_attn_metadata()
    except RuntimeError:  # a forward outside the engine (no forward context)
        return False
    starts = metadata.query_start_loc
    return (metadata.slot_mapping is not None and all(b - a == 1 for a, b in itertools.pairwise(starts))
            and all(n > 1 for n in metadata.seq_lens))


def _poll_stats() -> None:
    """The bug's thread: polls forever, and nothing asks it to stop."""
    while True:
        time.sleep(0.05)


class DecodeHelperMLP(LlamaMLP):
    """At the first decode step at TP > 1: starts a helper process, and never waits for it."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not hasattr(self, "helper") and decoding_at_tp():
            self.helper = subprocess.Popen([sys.executable, "-c", HELPER])
        return super().forward(x)


class JoinedHelperMLP(LlamaMLP):
    """Twin: at the first decode step at TP > 1, starts a helper process and waits for it."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not hasattr(self, "helper") and decoding_at_tp():
            self.helper = subprocess.Popen([sys.executable, "-c", "pass  # zoo helper, joined"])
            self.helper.wait()
        return super().forward(x)


class DecodeThreadMLP(LlamaMLP):
    """At the first decode step at TP > 1: starts a non-daemon thread, and never stops it."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not hasattr(self, "poller") and decoding_at_tp():
            self.poller = threading.Thread(target=_poll_stats, name="decode-stats-1", daemon=False)
            self.poller.start()
        return super().forward(x)


class StoppedThreadMLP(LlamaMLP):
    """Twin: at the first decode step at TP > 1, starts a daemon thread; stops and joins it at the next one."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if decoding_at_tp():
            if not hasattr(self, "poller"):
                self.stop = threading.Event()
                self.poller = threading.Thread(target=self.stop.wait, name="decode-stats-1", daemon=True)
                self.poller.start()
            elif self.poller.is_alive():
                self.stop.set()
                self.poller.join()
        return super().forward(x)


class LayoutFileDecoderLayer(LlamaDecoderLayer):
    """Layer 1 writes its shard layout to a fixed path in /tmp when built, and leaves it there."""

    directory: ClassVar[str] = "/tmp"
    remove: ClassVar[bool] = False

    def __init__(self, config: HFConfig, layer_idx: int, quant_config: QuantizationConfig | None = None,
                 prefix: str = "") -> None:
        super().__init__(config, layer_idx, quant_config, prefix)
        if layer_idx == 1:
            path = layout_path(self.directory)
            with open(path, "w") as f:
                f.write(f'{{"tp": {get_tp_group().world_size}}}')
            if self.remove:
                with open(path) as f:
                    f.read()
                os.unlink(path)


class RemovedFileDecoderLayer(LayoutFileDecoderLayer):
    """Twin: the same file, removed once read back."""

    remove = True


class ShmLayoutDecoderLayer(LayoutFileDecoderLayer):
    """The same layout as a shared-memory segment (a file in /dev/shm, as shm_open makes one), never unlinked."""

    directory = "/dev/shm"


class UnlinkedShmLayoutDecoderLayer(ShmLayoutDecoderLayer):
    """Twin: the same segment, unlinked once read back."""

    remove = True


def _example(name: str) -> dict:
    return {**LlamaForCausalLM.example_config, "architectures": [name]}


class DecodeHelperDecoderLayer(Layer1MLPLayer):
    mlp_cls = DecodeHelperMLP


class JoinedHelperDecoderLayer(Layer1MLPLayer):
    mlp_cls = JoinedHelperMLP


class DecodeThreadDecoderLayer(Layer1MLPLayer):
    mlp_cls = DecodeThreadMLP


class StoppedThreadDecoderLayer(Layer1MLPLayer):
    mlp_cls = StoppedThreadMLP


class DecodeHelperLlamaForCausalLM(LlamaForCausalLM):
    """Bug: a helper process left running, started at the first decode step at TP > 1."""

    decoder_layer_cls = DecodeHelperDecoderLayer
    example_config: ClassVar[dict] = _example("DecodeHelperLlamaForCausalLM")


class JoinedHelperLlamaForCausalLM(LlamaForCausalLM):
    """Twin: the helper process is waited for."""

    decoder_layer_cls = JoinedHelperDecoderLayer
    example_config: ClassVar[dict] = _example("JoinedHelperLlamaForCausalLM")


class DecodeThreadLlamaForCausalLM(LlamaForCausalLM):
    """Bug: a non-daemon thread left running, started at the first decode step at TP > 1."""

    decoder_layer_cls = DecodeThreadDecoderLayer
    example_config: ClassVar[dict] = _example("DecodeThreadLlamaForCausalLM")


class StoppedThreadLlamaForCausalLM(LlamaForCausalLM):
    """Twin: a daemon thread, stopped and joined at the next decode step."""

    decoder_layer_cls = StoppedThreadDecoderLayer
    example_config: ClassVar[dict] = _example("StoppedThreadLlamaForCausalLM")


class TmpFileLlamaForCausalLM(LlamaForCausalLM):
    """Bug: a file at a fixed path in /tmp, written at build and left there."""

    decoder_layer_cls = LayoutFileDecoderLayer
    example_config: ClassVar[dict] = _example("TmpFileLlamaForCausalLM")


class RemovedTmpFileLlamaForCausalLM(LlamaForCausalLM):
    """Twin: the same file, removed once read back."""

    decoder_layer_cls = RemovedFileDecoderLayer
    example_config: ClassVar[dict] = _example("RemovedTmpFileLlamaForCausalLM")


class ShmSegmentLlamaForCausalLM(LlamaForCausalLM):
    """Bug: a shared-memory segment at a fixed name, written at build and never unlinked."""

    decoder_layer_cls = ShmLayoutDecoderLayer
    example_config: ClassVar[dict] = _example("ShmSegmentLlamaForCausalLM")


class UnlinkedShmSegmentLlamaForCausalLM(LlamaForCausalLM):
    """Twin: the same segment, unlinked once read back."""

    decoder_layer_cls = UnlinkedShmLayoutDecoderLayer
    example_config: ClassVar[dict] = _example("UnlinkedShmSegmentLlamaForCausalLM")
