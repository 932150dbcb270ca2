"""quant[METHOD,tp=N]: quantized weights load or convert at startup, scales shard correctly, bytes are exact.

For an architecture that declares SupportsQuant, three engines start on its tiny checkpoint:
- the unquantized one at TP=1 (the reference);
- ``quantization=METHOD`` at TP=1, converting the checkpoint at startup;
- its pre-quantized twin (``make_quantized_checkpoint``: 8-bit weights, ``weight_scale`` tensors,
  ``quantization_config``) at TP=N, each rank loading its shard of weights and scales.
The pre-quantized engine at TP=N must generate exactly the tokens of the converting one at TP=1
(at tp=1 this proves loading equals converting; at tp=N, that weights and scales shard as they
should), measure exactly the bytes ``engine_ref.memory.estimate`` predicts per rank, and both
quantized engines' logits must stay within the tolerance below of the reference's.

Tolerance, derived: a quantized weight ``W`` is used as ``deq(W) = W + E``, with relative error
``eps_W = ||E|| / ||W||`` (bounded by the format: fp8 rounds to 2^-4 of each value, int8 to half a
scale step). To first order, each matmul on a token's path adds its ``eps_W`` to the relative
error of its output, and RMSNorm renormalises between layers, so the logits' relative error
``||L_q - L|| / ||L||`` stays under ``sum(eps_W)`` over the quantized weights; ``eps_W`` is measured
on the TP=1 engines (``dequantized_weights`` against the reference's weights). The error must also
be above 0: an engine whose logits equal the reference's quantized nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pytest_enginecheck.checks import CheckContext, CheckFailure, CheckSkip
from pytest_enginecheck.checks.tiny_engine import (
    DEVICE_MEMORY,
    MAX_MODEL_LEN,
    MAX_TOKENS,
    prompts,
    start_engine,
    tiny_checkpoint,
    verify_tp,
)
from pytest_enginecheck.targets import engine_ref_registry


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
    """On each rank: the weights its matmuls use, in float32: those of ``names``, or every quantized one
    (dequantized by its quant method)."""
    model = worker.model
    if names is not None:
        return {name: model.get_parameter(name).detach().float().cpu() for name in names}
    weights = {}
    for prefix, module in model.named_modules():
        dequantized = getattr(getattr(module, "quant_method", None), "dequantized_weights", None)
        if dequantized is not None:
            weights.update({f"{prefix}.{name}": w.cpu() for name, w in dequantized(module).items()})
    return weights


def relative_error(actual: Any, expected: Any) -> float:
    """``||actual - expected|| / ||expected||`` (tensors, or lists of them taken together)."""
    import torch

    if isinstance(actual, list):
        actual, expected = torch.cat([a.flatten() for a in actual]), torch.cat([e.flatten() for e in expected])
    return float((actual - expected).norm() / expected.norm())


@dataclass
class EngineRun:
    """What one engine start gave: greedy tokens, logits of the prompts (rank 0's), weights, the report."""

    tokens: list[list[int]]
    logits: list[Any]
    weights: dict[str, Any]
    report: Any


def run_engine(ctx: CheckContext, ckpt: Path, tp: int, quantization: str | None = None,
               weight_names: list[str] | None = None) -> EngineRun:
    """Start an engine, generate greedily, read its prompt logits and (at TP=1) its matmul weights.

    Its profile run is one sequence of max_model_len (the memory accounting is the budget check's).
    """
    with start_engine(ctx, ckpt, tp, quantization=quantization, max_num_batched_tokens=MAX_MODEL_LEN) as llm:
        vocab = llm.engine.config.model_config.hf_text_config.vocab_size
        tokens = llm.generate(prompts(vocab), max_tokens=MAX_TOKENS, ignore_eos=True)
        logits = llm.engine.executor.collective_rpc(prompt_logits, args=(prompts(vocab),))[0]
        weights = llm.engine.executor.collective_rpc(matmul_weights, args=(weight_names,))[0] if tp == 1 else {}
        return EngineRun(tokens, logits, weights, llm.startup_report)


def run(ctx: CheckContext) -> dict[str, Any]:
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
    converted = run_engine(ctx, ckpt, 1, method)
    if not converted.weights:
        raise CheckFailure(
            f"With quantization={method!r}, no layer of {ctx.architecture} holds a quantized weight: its linear "
            f"layers and experts must be built with the model's quant_config (and their module name as prefix).",
            {"kind": "not_quantized"})
    reference = run_engine(ctx, ckpt, 1, weight_names=sorted(converted.weights))
    sharded = run_engine(ctx, prequantized, ctx.tp)
    eps = {name: relative_error(w, reference.weights[name]) for name, w in converted.weights.items()}
    tolerance = sum(eps.values())
    errors = {"converted_tp1": relative_error(converted.logits, reference.logits),
              f"prequantized_tp{ctx.tp}": relative_error(sharded.logits, reference.logits)}
    detail: dict[str, Any] = {
        "quantization": method, "tensor_parallel_size": ctx.tp, "tolerance": tolerance, "logits_error": errors,
        "weight_bytes_per_rank": [w.memory.weights for w in sharded.report.workers],
        "unquantized_weight_bytes": reference.report.workers[0].memory.weights,
        "bytes_read_per_rank": [w.bytes_read for w in sharded.report.workers],
        "load_seconds_per_rank": [round(w.phases.get("load_model", 0.0), 4) for w in sharded.report.workers],
    }
    if sharded.tokens != converted.tokens:
        i = next(i for i, (a, b) in enumerate(zip(sharded.tokens, converted.tokens, strict=True)) if a != b)
        raise CheckFailure(
            f"The pre-quantized {method} checkpoint of {ctx.architecture} at tensor_parallel_size={ctx.tp} generates "
            f"other tokens than quantization={method!r} at tensor_parallel_size=1 (prompt {i}: {sharded.tokens[i]} vs "
            f"{converted.tokens[i]}): a weight or its weight_scale is loaded into the wrong shard or slot. Check the "
            f"weight_loader of the layers this model changed, for the scales too.",
            {**detail, "kind": "tp_mismatch", "outputs": sharded.tokens, "reference": converted.tokens})
    for engine, error in errors.items():
        if not 0 < error <= tolerance:
            why = ("equal the unquantized model's: nothing was quantized" if error == 0 else
                   f"differ from the unquantized model's by {error:.4g} (relative), more than the {tolerance:.4g} "
                   f"its weights' quantization errors allow (their sum, first order): a scale is wrong or misapplied")
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
