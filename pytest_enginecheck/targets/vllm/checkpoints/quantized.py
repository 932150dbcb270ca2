"""Pre-quantized tiny checkpoints in compressed-tensors' own layout, and their dequantized twins (the quant check's).

The tiny checkpoint is quantized here, without llm-compressor: every linear weight of the decoder layers (attention,
MLP, MoE experts) becomes ``weight`` + ``weight_scale`` (int8) or ``weight_packed`` + ``weight_scale`` +
``weight_shape`` (w4a16); ``lm_head``, embeddings, norms and a MoE router stay as they are (llm-compressor's
``ignore``). The scales are powers of two (``power_of_two_scale``), so the dequantized twin, the unquantized
checkpoint with each of those weights replaced by ``deq(W) = q * weight_scale``, holds deq(W) exactly, in float32
and in bfloat16.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

GROUP_SIZE = 32  # w4a16's group of input channels per scale (vLLM's CPU kernel needs sizes in multiples of 32)
IGNORED = ("lm_head", "re:.*block_sparse_moe[.]gate$", "re:.*mlp[.]gate$")  # never quantized (router, lm_head)


@dataclass(frozen=True)
class QuantScheme:
    """One compressed-tensors scheme: its config group, its checkpoint tensors and what it dequantizes to."""

    name: str
    format: str
    weights: dict[str, Any]
    input_activations: dict[str, Any] | None
    activation_quantized: bool  # activations are quantized at run time (exact on the local oracle's inputs)
    dtype: str  # the dtype vLLM's CPU kernel of the scheme computes in (see engine_dtype)

    def quantization_config(self) -> dict[str, Any]:
        """``config.json``'s ``quantization_config``, as llm-compressor writes it."""
        group = {"targets": ["Linear"], "weights": self.weights, "input_activations": self.input_activations,
                 "output_activations": None, "format": self.format}
        return {"quant_method": "compressed-tensors", "format": self.format, "config_groups": {"group_0": group},
                "ignore": list(IGNORED), "quantization_status": "compressed", "kv_cache_scheme": None,
                "global_compression_ratio": None, "sparsity_config": {}, "transform_config": {}, "version": "0.17.0"}


def _quant_args(bits: int, strategy: str, group_size: int | None, dynamic: bool = False) -> dict[str, Any]:
    return {"num_bits": bits, "type": "int", "symmetric": True, "strategy": strategy, "group_size": group_size,
            "dynamic": dynamic, "block_structure": None, "actorder": None, "observer": None if dynamic else "minmax",
            "observer_kwargs": {}}


METHODS: dict[str, QuantScheme] = {
    "int8": QuantScheme("int8", "int-quantized", _quant_args(8, "channel", None),
                        _quant_args(8, "token", None, dynamic=True), activation_quantized=True, dtype="float32"),
    # vLLM 0.32's cpu_gemm_wna16 has no float32 kernel ("not implemented for 'Float'"): bfloat16, as it ships
    "w4a16": QuantScheme("w4a16", "pack-quantized", _quant_args(4, "group", GROUP_SIZE), None,
                         activation_quantized=False, dtype="bfloat16"),
}


def is_quantized(name: str) -> bool:
    """Whether the checkpoint tensor ``name`` is a linear weight the schemes quantize (see IGNORED)."""
    if not name.endswith(".weight") or ".layers." not in name:
        return False
    module = name[: -len(".weight")]
    if any(re.match(pattern[3:], module) for pattern in IGNORED if pattern.startswith("re:")):
        return False
    return "norm" not in module.rsplit(".", 1)[-1]  # input_layernorm, q_norm, ...: not a linear layer


def quantize(scheme: QuantScheme, weight: Any) -> tuple[dict[str, Any], Any]:
    """The scheme's checkpoint tensors of one float weight ``[out, in]`` (suffix -> tensor), and ``deq(W)``."""
    import torch

    w = weight.float()
    if scheme.name == "int8":
        scale = power_of_two_scale(w.abs().amax(dim=1, keepdim=True), 127)
        q = torch.round(w / scale).clamp(-128, 127).to(torch.int8)
        return {"weight": q, "weight_scale": scale}, q.float() * scale
    out, inp = w.shape
    groups = w.reshape(out, inp // GROUP_SIZE, GROUP_SIZE)
    scale = power_of_two_scale(groups.abs().amax(dim=2), 7)  # [out, groups]
    q = torch.round(groups / scale[..., None]).clamp(-8, 7).to(torch.int8)
    deq = (q.float() * scale[..., None]).reshape(out, inp)
    return {"weight_packed": pack_int4(q.reshape(out, inp)), "weight_scale": scale,
            "weight_shape": torch.tensor([out, inp], dtype=torch.int64)}, deq


def power_of_two_scale(largest: Any, qmax: int) -> Any:
    """The least power of two ``s`` with ``largest / s <= qmax``: a symmetric scale (any scale is valid for the
    format) whose products ``q * s`` are exact in every float type, so deq(W) is exact in the model dtype and the
    local products below are exact sums."""
    import torch

    return torch.exp2(torch.ceil(torch.log2(largest.clamp(min=2.0**-60) / qmax)))


def pack_int4(q: Any) -> Any:
    """compressed-tensors' ``pack_to_int32`` of 4-bit values along dim 1: value ``i`` of each 8, plus 8, in bits
    ``4i..4i+3`` of one int32."""
    import torch

    unsigned = (q.to(torch.int32) + 8).reshape(q.shape[0], -1, 8)
    packed = torch.zeros(unsigned.shape[:2], dtype=torch.int64)
    for i in range(8):
        packed |= unsigned[..., i].to(torch.int64) << (4 * i)
    return torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)  # the same 32 bits, signed


def _write(source: Path, target: Path, tensors: dict[str, Any], config_update: Callable[[dict[str, Any]], None]
           ) -> None:
    from safetensors.torch import save_file

    for name in os.listdir(source):
        if not name.endswith(".safetensors") and os.path.isfile(source / name):
            shutil.copy(source / name, target / name)
    config = json.loads((source / "config.json").read_text())
    config_update(config)
    (target / "config.json").write_text(json.dumps(config, indent=2))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(target / "model.safetensors"))


def make_quantized_checkpoints(source: Path, scheme: QuantScheme, quantized: Path, dequantized: Path,
                               change: Callable[[str, dict[str, Any]], None] | None = None) -> list[str]:
    """Write ``source``'s pre-quantized twin in ``scheme``'s layout and its dequantized twin; the quantized weights'
    names. ``change(name, tensors)`` may alter a weight's checkpoint tensors after ``deq(W)`` is taken (the tests'
    planted bugs: a scale the oracle does not share)."""
    from safetensors.torch import load_file

    original = load_file(str(source / "model.safetensors"))
    quant, deq, names = {}, {}, []
    for name, tensor in original.items():
        if not is_quantized(name):
            quant[name] = deq[name] = tensor
            continue
        parts, deq[name] = quantize(scheme, tensor)
        if change is not None:
            change(name, parts)
        module = name[: -len(".weight")]
        quant.update({f"{module}.{suffix}": t for suffix, t in parts.items()})
        names.append(name)

    def with_quantization(config: dict[str, Any]) -> None:
        config["quantization_config"] = scheme.quantization_config()

    _write(source, quantized, quant, with_quantization)
    _write(source, dequantized, deq, lambda config: None)
    return names


def _in_fork(fn: Callable[..., Any], *args: Any) -> None:
    """``fn(*args)`` in a fork of this process, its exception re-raised here as a RuntimeError with its traceback.
    The check process must itself run no torch op before it forks vLLM's ranks: a rank forked after torch's
    OpenMP pool started here hangs in its first parallel op (measured: the rotary cache in vLLM's model init)."""
    import traceback

    with tempfile.NamedTemporaryFile("r", suffix=".traceback") as told:
        pid = os.fork()
        if pid == 0:
            code = 0
            try:
                fn(*args)
            except BaseException:  # noqa: BLE001 - handed to the parent
                with open(told.name, "w") as f:
                    f.write(traceback.format_exc())
                code = 1
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        if status:
            raise RuntimeError(f"writing the quantized checkpoints failed (wait status {status}):\n{told.read()}")


def quantized_checkpoints(source: Path, method: str, workdir: str) -> tuple[Path, Path]:
    """The pre-quantized and the dequantized twin of ``source`` under ``workdir``, made once
    (``checkpoints.made_once``)."""
    from pytest_enginecheck.targets.vllm.checkpoints.tiny import made_once

    def make(tmp: Path) -> None:
        (tmp / "quantized").mkdir()
        (tmp / "dequantized").mkdir()
        _in_fork(make_quantized_checkpoints, source, METHODS[method], tmp / "quantized", tmp / "dequantized")

    base = made_once(Path(workdir) / "vllm-quant" / f"{source.name}-{method}", "dequantized/config.json", make)
    return base / "quantized", base / "dequantized"
