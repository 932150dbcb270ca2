"""quant[METHOD,tp=N]: quantized weights load or convert at startup, scales shard correctly, bytes are exact.

For an architecture that declares SupportsQuant, engines start on its tiny checkpoint and two twins of it:
the pre-quantized twin (``make_quantized_checkpoint``: 8-bit weights, ``weight_scale`` tensors,
``quantization_config``) and the dequantized twin (``make_dequantized_checkpoint``: unquantized, each
weight ``deq(W) = (weight * weight_scale).to(dtype)`` in the dtype the quantized layers compute in).

The exact oracle. Every method engine_ref has (fp8, fbgemm_fp8, int8: ``ScaledLinearMethod`` /
``ScaledMoEMethod``) is weight-only: ``apply`` dequantizes the weight into the activation dtype and runs
the unquantized matmul; no activation is quantized (fp8's ``activation_scheme: dynamic`` is read and has
no effect on CPU). So a correct quantized engine computes exactly what the unquantized engine computes on
the dequantized twin, and must produce its logits up to float rounding (``oracle_tolerance``):
- ``quantization=METHOD`` at TP=1 (converting the unquantized checkpoint at startup; its scales equal the
  twin's by construction) against the dequantized twin at TP=1;
- the pre-quantized twin at TP=N (each rank loading its shard of weights and scales) against the
  dequantized twin at TP=N, once that twin is shown to give its TP=1 logits (else the unquantized model's own TP
  bug, load[tp=N]'s finding, is reported as such: a quantized engine cannot be judged against a wrong oracle).
On a difference the weights each rank's quant method dequantizes are compared with the oracle's, naming
the weight that differs (a scale loaded, sharded or fixed up wrongly), or saying that none does (a layer
computes with something other than its quant method's weight).

Then the pre-quantized engine at TP=N must generate the tokens of the converting one at TP=1, and measure
exactly the bytes ``engine_ref.memory.estimate`` predicts per rank. Last, a sanity check against the
original weights, loose by nature: the logits' relative error against the unquantized engine must be above
0 (something was quantized) and under ``sum(eps_W)``, the weights' relative quantization errors
``||deq(W) - W|| / ||W||`` summed (a first-order estimate, not a bound: ``||E x|| / ||W x||`` is not bounded
by ``||E|| / ||W||``; it only catches gross errors, the oracle catches the rest).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pytest_enginecheck.checks import CheckContext, CheckFailure, CheckSkip
from pytest_enginecheck.prompts import short_prompts
from pytest_enginecheck.targets.engine_ref import cuda_ranks
from pytest_enginecheck.targets.engine_ref.registry import engine_ref_registry
from pytest_enginecheck.targets.engine_ref.tiny_engine import (
    DEVICE_MEMORY,
    MAX_MODEL_LEN,
    MAX_TOKENS,
    start_engine,
    tiny_checkpoint,
    verify_tp,
)


def prompt_logits(worker: Any, token_ids: list[list[int]]) -> list[Any]:
    """On each rank (``collective_rpc``): the logits of every position of each prompt, without the KV cache."""
    import torch

    from engine_ref.model_executor.forward_context import AttentionMetadata, set_forward_context

    device, logits = worker.device, []
    with torch.inference_mode():
        for ids in token_ids:
            with set_forward_context(AttentionMetadata([0, len(ids)], [len(ids)])):
                hidden = worker.model(torch.tensor(ids, device=device), torch.arange(len(ids), device=device))
            logits.append(worker.model.compute_logits(hidden).float().cpu())
    return logits


def matmul_weights(worker: Any, names: list[str] | None = None) -> dict[str, Any]:
    """On each rank: the weights its matmuls use, in the model dtype (the one a quant method dequantizes into),
    returned as float32: those of ``names``, or every quantized one (dequantized by its quant method)."""
    model, dtype = worker.model, worker.config.model_config.torch_dtype
    if names is not None:
        return {name: model.get_parameter(name).detach().to(dtype).float().cpu() for name in names}
    weights = {}
    for prefix, module in model.named_modules():
        dequantized = getattr(getattr(module, "quant_method", None), "dequantized_weights", None)
        if dequantized is not None:
            weights.update({f"{prefix}.{name}": w.float().cpu() for name, w in dequantized(module, dtype).items()})
    return weights


def relative_error(actual: Any, expected: Any) -> float:
    """``||actual - expected|| / ||expected||`` (tensors, or lists of them taken together)."""
    import torch

    if isinstance(actual, list):
        actual, expected = torch.cat([a.flatten() for a in actual]), torch.cat([e.flatten() for e in expected])
    return float((actual - expected).norm() / expected.norm())


@dataclass
class EngineRun:
    """What one engine start gave: greedy tokens, logits of the prompts (rank 0's), each rank's matmul weights
    (by parameter name), the startup report."""

    tokens: list[list[int]]
    logits: list[Any]
    weights: list[dict[str, Any]]
    report: Any


def run_engine(ctx: CheckContext, ckpt: Path, tp: int, quantization: str | None = None,
               weight_names: list[str] | None = None) -> EngineRun:
    """Start an engine, generate greedily, read its prompt logits and every rank's matmul weights.

    Its profile run is one sequence of max_model_len (the memory accounting is the budget check's).
    """
    with start_engine(ctx, ckpt, tp, quantization=quantization, max_num_batched_tokens=MAX_MODEL_LEN) as llm:
        # The short prompts: the oracle holds at any length, but an MoE's int8 router picks other experts for a few
        # of the long prompts' tokens, which the sanity bound (first order) does not allow for: the tiny Mixtral's
        # logits error is 0.019 on these and 0.064 on the load check's, over a bound of 0.048.
        batch = short_prompts(llm.engine.config.model_config.hf_text_config.vocab_size)
        tokens = cuda_ranks.generate(ctx, llm, batch, max_tokens=MAX_TOKENS, ignore_eos=True)
        logits = llm.engine.executor.collective_rpc(prompt_logits, args=(batch,))[0]
        weights = llm.engine.executor.collective_rpc(matmul_weights, args=(weight_names,))
        return EngineRun(tokens, logits, weights, llm.startup_report)


def dequantized_checkpoint(ctx: CheckContext, prequantized: Path) -> Path:
    """The dequantized twin of the pre-quantized checkpoint, under the session's workdir, made once (atomically)."""
    from engine_ref.model_executor.model_loader.quantized_checkpoint import make_dequantized_checkpoint

    path = prequantized.with_name(f"{prequantized.name}-dequantized")
    if (path / "config.json").exists():
        return path
    tmp = Path(tempfile.mkdtemp(dir=ctx.workdir, prefix=f".{path.name}-"))
    try:
        make_dequantized_checkpoint(prequantized, tmp)
        os.replace(tmp, path)
    except OSError:  # another process of this session made it first
        pass
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return path


def oracle_tolerance(weights: dict[str, Any], dtype: Any) -> float:
    """How far a correct quantized engine's logits may be from the oracle's, relative to the largest |logit|.

    Why it is sound: both engines run the same operations on bitwise the same weights (the twin stores
    ``deq(W)`` computed as ``dequantize`` computes it, in the same ``dtype``) and the same inputs, so a correct
    engine agrees exactly, unless a kernel sums in another order (a GEMM blocking on other strides or
    alignment, an all-reduce). A sum of ``K`` products reordered moves by at most ``gamma_K ~ K u`` times
    ``sum |w_i x_i|`` (Higham, Accuracy and Stability of Numerical Algorithms, 3.1; ``u``: the unit roundoff
    of ``dtype``), and each engine is within that of the exact result, so the two are within ``2 K u`` per
    matmul. Summed over the matmuls of a token's path (at most 2 per weight: the weight matmuls and, at most
    as many, attention's score and value matmuls; plus lm_head), with ``K`` the largest inner size, that is
    ``2 * 2 (weights + 1) * K * u``. What is rigorous is the per-matmul step; summing them assumes, as
    first-order analysis does, that a rounding-sized relative change of one matmul's output reaches the
    logits no larger (RMSNorm renormalises between layers). That is safe here because the assumption only
    has to hold for perturbations of size ``K u``, which a correct engine does not even produce: for the
    float32 tiny Llama (8 quantized weights, K=128) the tolerance is 2.7e-4, a correct engine measures
    exactly 0 (every method, TP=1 and 2), and a scale 5 % off in layer 1's down_proj measures 2.5e-2 to
    2.8e-2 (int8, fp8), so 1 % off is about 5e-3, 20 times the tolerance. It is loose for bfloat16 (``u``
    = 2^-8); the check's tiny checkpoints are float32.
    """
    import torch

    inner = max(w.shape[-1] for w in weights.values())
    return 2 * 2 * (len(weights) + 1) * inner * torch.finfo(dtype).eps / 2


@dataclass
class LogitsDifference:
    """The largest difference between two engines' prompt logits, and where it is."""

    prompt: int
    position: int
    token: int
    actual: float
    expected: float
    scale: float  # the largest |logit| of the expected engine

    @property
    def relative(self) -> float:
        return abs(self.actual - self.expected) / self.scale

    def describe(self) -> str:
        return (f"{abs(self.actual - self.expected):.4g} ({self.relative:.3g} of the largest |logit| "
                f"{self.scale:.4g}) at prompt {self.prompt}, position {self.position}, token {self.token}: "
                f"{self.actual:.6g} instead of {self.expected:.6g}")


def largest_difference(actual: list[Any], expected: list[Any]) -> LogitsDifference:
    """Where ``actual`` and ``expected`` (per prompt, ``[positions, vocab]``) differ most."""
    diffs = [(a - e).abs().max() for a, e in zip(actual, expected, strict=True)]
    prompt = max(range(len(diffs)), key=lambda i: float(diffs[i]))
    a, e = actual[prompt], expected[prompt]
    position, token = divmod(int((a - e).abs().argmax()), a.shape[-1])
    return LogitsDifference(prompt, position, token, float(a[position, token]), float(e[position, token]),
                            max(float(x.abs().max()) for x in expected))


def weight_differences(actual: list[dict[str, Any]], expected: list[dict[str, Any]], dtype: Any
                       ) -> list[tuple[str, int, float, float]]:
    """(name, rank, relative error, least-squares ratio) of each rank's weight that is not ``expected``'s
    (beyond one rounding of ``dtype``), largest error first."""
    import torch

    found = []
    for rank, (weights, oracle) in enumerate(zip(actual, expected, strict=True)):
        for name, w in weights.items():
            error = relative_error(w, oracle[name])
            if error > torch.finfo(dtype).eps:
                found.append((name, rank, error, float((w * oracle[name]).sum() / (oracle[name] ** 2).sum())))
    return sorted(found, key=lambda d: -d[2])


def check_oracle(ctx: CheckContext, engine: str, run: EngineRun, oracle: EngineRun, tolerance: float, dtype: Any,
                 detail: dict[str, Any]) -> None:
    """CheckFailure unless ``run``'s logits are the oracle's within ``tolerance``, naming the weight that differs."""
    difference = largest_difference(run.logits, oracle.logits)
    detail["oracle_difference"][engine] = difference.relative
    if difference.relative <= tolerance:
        return
    weights = weight_differences(run.weights, oracle.weights, dtype)
    if weights:
        name, rank, error, ratio = weights[0]
        more = f" ({len(weights) - 1} more: {', '.join(sorted({w[0] for w in weights[1:]}))})" if weights[1:] else ""
        blame = (f"The weight its quant method dequantizes differs from deq(W) in {name} (rank {rank}: relative "
                 f"error {error:.3g}, {ratio:.4g}x deq(W)){more}: its weight_scale is loaded, sharded or changed after "
                 f"loading wrongly; check that layer's weight_loader and its quant method's "
                 f"process_weights_after_loading.")
    else:
        blame = ("Every weight the quant methods dequantize equals deq(W) on every rank, so a layer computes with "
                 "something other than its quant method's weight (a hint, not located: a forward that bypasses "
                 "quant_method.apply, or uses the 8-bit weight or its scale directly).")
    raise CheckFailure(
        f"The {ctx.quantization} logits of {ctx.architecture} ({engine}) are not those of the unquantized engine "
        f"loaded with the dequantized weights deq(W) at the same tensor_parallel_size (the exact oracle of a "
        f"weight-only method): they differ by {difference.describe()}, above the float-rounding tolerance "
        f"{tolerance:.3g}. {blame}",
        {**detail, "kind": "oracle_mismatch", "weight_differences": [
            {"name": n, "rank": r, "relative_error": e, "ratio": q} for n, r, e, q in weights]})


def verify_oracle_across_tp(ctx: CheckContext, oracle: EngineRun, oracle_tp1: EngineRun, tolerance: float,
                            detail: dict[str, Any]) -> None:
    """CheckFailure unless the unquantized engine on deq(W) at TP=N gives its TP=1 logits within ``tolerance`` (a
    TP split only reorders sums, which the tolerance covers): otherwise the TP=N oracle itself is wrong, the
    unquantized model's TP bug (load[tp=N]'s finding), and the quantized engine cannot be judged against it."""
    difference = largest_difference(oracle.logits, oracle_tp1.logits)
    detail["oracle_difference"][f"dequantized_tp{ctx.tp}"] = difference.relative
    if difference.relative > tolerance:
        raise CheckFailure(
            f"The unquantized engine loaded with the dequantized weights deq(W) of {ctx.architecture} at "
            f"tensor_parallel_size={ctx.tp} does not produce its logits at tensor_parallel_size=1: they differ by "
            f"{difference.describe()}, above the float-rounding tolerance {tolerance:.3g}. The unquantized model "
            f"itself differs between TP sizes (see load[tp={ctx.tp}]), so its {ctx.quantization} weights at "
            f"tensor_parallel_size={ctx.tp} cannot be judged against it.", {**detail, "kind": "tp_mismatch"})


def run(ctx: CheckContext) -> dict[str, Any]:
    from engine_ref.config import ModelConfig
    from engine_ref.memory.compare import compare_with_report
    from engine_ref.memory.estimate import estimate_memory
    from engine_ref.model_executor.models.interfaces import ModelInfo

    method, registry = ctx.quantization, engine_ref_registry(ctx.spec)
    if method is None:
        raise ValueError("the quant check needs a CheckContext with quantization set")
    if not ModelInfo.from_model_cls(ctx.architecture, registry.resolve_model_cls(ctx.architecture)
                                    ).supports_quantization:
        raise CheckSkip(f"{ctx.architecture} does not declare SupportsQuant, so the engine refuses quantization for "
                        f"it; declare SupportsQuant once its layers take quant_config and prefix")
    ckpt = tiny_checkpoint(ctx, registry)
    verify_tp(ckpt, ctx.tp)
    prequantized = tiny_checkpoint(ctx, registry, method)
    dequantized = dequantized_checkpoint(ctx, prequantized)
    dtype = ModelConfig(str(prequantized)).torch_dtype
    converted = run_engine(ctx, ckpt, 1, method)
    if not converted.weights[0]:
        raise CheckFailure(
            f"With quantization={method!r}, no layer of {ctx.architecture} holds a quantized weight: its linear "
            f"layers and experts must be built with the model's quant_config (and their module name as prefix).",
            {"kind": "not_quantized"})
    names = sorted(converted.weights[0])
    tolerance = oracle_tolerance(converted.weights[0], dtype)
    detail: dict[str, Any] = {"quantization": method, "tensor_parallel_size": ctx.tp,
                              "oracle_tolerance": tolerance, "oracle_difference": {}}
    oracle = run_engine(ctx, dequantized, 1, weight_names=names)
    check_oracle(ctx, "converted_tp1", converted, oracle, tolerance, dtype, detail)
    sharded = run_engine(ctx, prequantized, ctx.tp)
    if ctx.tp > 1:
        oracle_tp1, oracle = oracle, run_engine(ctx, dequantized, ctx.tp, weight_names=names)
        verify_oracle_across_tp(ctx, oracle, oracle_tp1, tolerance, detail)
    check_oracle(ctx, f"prequantized_tp{ctx.tp}", sharded, oracle, tolerance, dtype, detail)
    detail.update({
        "weight_bytes_per_rank": [w.memory.weights for w in sharded.report.workers],
        "bytes_read_per_rank": [w.bytes_read for w in sharded.report.workers],
        "load_seconds_per_rank": [round(w.phases.get("load_model", 0.0), 4) for w in sharded.report.workers],
    })
    if sharded.tokens != converted.tokens:
        i = next(i for i, (a, b) in enumerate(zip(sharded.tokens, converted.tokens, strict=True)) if a != b)
        raise CheckFailure(
            f"The pre-quantized {method} checkpoint of {ctx.architecture} at tensor_parallel_size={ctx.tp} generates "
            f"other tokens than quantization={method!r} at tensor_parallel_size=1 (prompt {i}: {sharded.tokens[i]} vs "
            f"{converted.tokens[i]}), although each matches the unquantized engine on deq(W) at its TP size: the "
            f"unquantized model itself differs between TP sizes (see load[tp={ctx.tp}]).",
            {**detail, "kind": "tp_mismatch", "outputs": sharded.tokens, "reference": converted.tokens})
    reference = run_engine(ctx, ckpt, 1, weight_names=names)
    eps = {name: relative_error(w, reference.weights[0][name]) for name, w in converted.weights[0].items()}
    bound = sum(eps.values())
    errors = {"converted_tp1": relative_error(converted.logits, reference.logits),
              f"prequantized_tp{ctx.tp}": relative_error(sharded.logits, reference.logits)}
    detail.update({"tolerance": bound, "logits_error": errors,
                   "unquantized_weight_bytes": reference.report.workers[0].memory.weights})
    for engine, error in errors.items():
        if not 0 < error <= bound:
            why = ("equal the unquantized model's: nothing was quantized" if error == 0 else
                   f"differ from the unquantized model's by {error:.4g} (relative), more than the {bound:.4g} "
                   f"its weights' quantization errors suggest (their sum, a first-order estimate): the checkpoint's "
                   f"own scales or 8-bit values are far off")
            raise CheckFailure(f"The {method} logits of {ctx.architecture} ({engine}) {why}.",
                               {**detail, "kind": "quant_error", "weight_errors": eps})
    estimate = estimate_memory(prequantized, device_memory=DEVICE_MEMORY, tensor_parallel_size=ctx.tp,
                               max_model_len=MAX_MODEL_LEN, max_num_batched_tokens=MAX_MODEL_LEN, registry=registry)
    comparison = compare_with_report(estimate, sharded.report)
    if not comparison.ok:
        raise CheckFailure(
            f"The measured memory of {ctx.architecture} with {method} weights at tensor_parallel_size={ctx.tp} is not "
            f"what engine_ref.memory.estimate predicts: {comparison.describe()}",
            {**detail, "kind": "estimate_mismatch", "estimate": estimate.to_dict()})
    return detail
