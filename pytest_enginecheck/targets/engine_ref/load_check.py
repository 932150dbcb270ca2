"""load: the architecture builds and loads at TP=N on real CPU ranks, its TP=1 output does not depend on the
seed, and TP=N output equals TP=1.

Determinism comes first, at every TP size: TP=1 runs under the engine's seed and another, and the two must give
the same tokens and, in a hooked forward (tp_diagnosis.diagnose_seeds), the same output of every module (at TP=N,
the TP=1 reference runs under the other seed, and equal to TP=N it stands for both TP=1 runs). A
model whose output depends on the random number generator agrees with itself at TP=2 only because every rank is
seeded alike, so it is reported as nondeterministic (naming the first module whose output changes) instead of
comparing TP sizes. When TP=N disagrees with TP=1 (other tokens, or a start that fails where TP=1 starts), a second
TP=N run first tells a TP-only nondeterminism from a TP bug, then tp_diagnosis names the first module whose output
differs (the model's own output and compute_logits included) and whether its weights or its collective are wrong.
At TP=1, three oracles that are not the model itself, on one guarded build (``tp1_model``): decoding with the KV cache
gives the tokens and log-probabilities of recomputing without it (kv_consistency); a reference implementation
computes the same log-probabilities (verify_reference); every parameter holds what the checkpoint holds for it
(checkpoint_values).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from pytest_enginecheck.checks import CheckContext, CheckFailure
from pytest_enginecheck.prompts import DIAGNOSIS_PROMPT
from pytest_enginecheck.targets.engine_ref import cuda_ranks
from pytest_enginecheck.targets.engine_ref.checkpoint_values import verify_checkpoint_values
from pytest_enginecheck.targets.engine_ref.registry import engine_ref_registry
from pytest_enginecheck.targets.engine_ref.tiny_engine import checkpoint_prompts, greedy, tiny_checkpoint, verify_tp

if TYPE_CHECKING:
    from pytest_enginecheck.targets.engine_ref.tp_explain import Diagnosis

SEEDS = (0, 1)  # the engine's default seed, and the determinism run's other one
DIAGNOSIS_MARGIN_S = 2.0  # of --enginecheck-timeout, kept for reporting after a diagnosis that timed out
MIN_DIAGNOSIS_S = 5.0  # less left than this: the diagnosis is not run
BUILD_CUDA_HINT = ("Take the device from the engine (the device of the layer's parameters or of its input) instead "
                   "of asking torch.cuda while the model is built, or run with PYTORCH_NVML_BASED_CUDA_CHECK=1 so a "
                   "query uses NVML instead of cuInit.")
HINT = "Hint: check the weight_loader and the collectives of the layers this model changed."


def _diagnosis(ctx: CheckContext, ckpt: Any, prompt: list[int], started: bool = True,
               since: float | None = None) -> Diagnosis:
    """tp_diagnosis.diagnose's Diagnosis; when the diagnosis itself fails, one that says so with its error. When
    it finds that two TP=N runs disagree (``started``), raise the check's failure: nondeterministic at TP=N only.

    ``since``: when the check started (time.monotonic()); the diagnosis gets only what is left of --enginecheck-timeout,
    so a start that hung (and would hang the diagnosis too) is reported in the engine's words, not as the check's
    own timeout."""
    from pytest_enginecheck.targets.engine_ref.tp_diagnosis import diagnose
    from pytest_enginecheck.targets.engine_ref.tp_explain import Diagnosis

    timeout = max(10.0, ctx.options.timeout * 0.4)
    if since is not None:
        spent = time.monotonic() - since
        timeout = min(timeout, ctx.options.timeout - spent - DIAGNOSIS_MARGIN_S)
        if timeout < MIN_DIAGNOSIS_S:
            return Diagnosis(f"The diagnosis was not run: the check had spent {spent:.0f} s of its "
                             f"{ctx.options.timeout:g} s (--enginecheck-timeout), so it names no module.")
    try:
        diagnosis = diagnose(ctx.spec, ckpt, ctx.tp, prompt, timeout=timeout, started=started)
    except Exception as e:  # noqa: BLE001 - the check's own finding stands; the user learns why none was added
        lines = str(e).strip().splitlines() or [""]
        # A rank's failure reads "rank 0 of 2 failed:" and its traceback: the last line is the exception.
        error = f"{lines[0]} {lines[-1].strip()}" if lines[0].endswith(":") and len(lines) > 1 else lines[0]
        return Diagnosis(f"The diagnosis failed ({type(e).__name__}: {error}), so it names no module. {HINT}")
    if diagnosis.nondeterministic:
        raise tp_nondeterminism(ctx, "its tokens there differ from tensor_parallel_size=1's", diagnosis)
    return diagnosis


def tp_nondeterminism(ctx: CheckContext, what: str, diagnosis: Diagnosis) -> CheckFailure:
    """The failure of a model whose TP=N run does not reproduce itself (``diagnosis``: ``explain_rerun``'s), where
    TP=1 under two seeds agreed (verify_deterministic ran first): ``what`` TP=N did against TP=1."""
    return CheckFailure(
        f"{ctx.architecture} is nondeterministic at tensor_parallel_size={ctx.tp} only: {what}, and two runs at "
        f"tensor_parallel_size={ctx.tp} of the same prompt under the same seed do not agree with each other, where "
        f"two runs at tensor_parallel_size=1 under seeds {SEEDS[0]} and {SEEDS[1]} agree exactly. {diagnosis.text} "
        f"Its tensor parallelism was not compared with tensor_parallel_size=1 (a run that does not reproduce itself "
        f"cannot be).",
        {"kind": "nondeterministic", "tensor_parallel_size": ctx.tp, "module": diagnosis.module,
         "diagnosis": diagnosis.text})


def verify_deterministic(ctx: CheckContext, ckpt: Any, reference: list[list[int]],
                         again: list[list[int]] | None = None) -> dict[str, Any]:
    """Fail when TP=1 under the second seed (``again``, run here when None) gives other tokens than ``reference``
    (TP=1 under the first), or a hooked forward under the two seeds gives another output in any module; return
    the run's detail."""
    from pytest_enginecheck.targets.engine_ref.tp_diagnosis import diagnose_seeds

    if again is None:
        again, _ = greedy(ctx, ckpt, 1, seed=SEEDS[1])
    changed = [i for i, (a, b) in enumerate(zip(reference, again, strict=True)) if a != b]
    i = changed[0] if changed else DIAGNOSIS_PROMPT  # a short one when the tokens agree
    finding = diagnose_seeds(ctx.spec, ckpt, reference_prompt(ckpt, i), SEEDS)
    if finding is None and not changed:
        return {"deterministic_seeds": list(SEEDS)}
    a, b = SEEDS
    runs = f"Two runs at tensor_parallel_size=1 that differ only in the seed ({a} and {b})"
    if changed:
        what = f"{runs} generate different tokens (prompt {i}: {reference[i]} vs {again[i]})"
    else:
        what = f"{runs} generate the same tokens, but not the same module outputs (prompt {i})"
    # None: every output the hooked prefill compared agrees exactly, the model's own and its logits included
    found = finding.text if finding is not None else (
        f"The hooked forward of prompt {i} (its prefill, without the KV cache) gives the same output under both "
        f"seeds in every module, the model's own output and its logits included: the difference arises in decoding "
        f"with the KV cache.")
    unused = " Its tensor parallelism was not compared (its seeded-alike ranks agree whatever the seed does)."
    raise CheckFailure(
        f"{ctx.architecture} is nondeterministic: {what}. {found}{unused if ctx.tp > 1 else ''}",
        {"kind": "nondeterministic", "seeds": list(SEEDS), "outputs": reference, "outputs_other_seed": again,
         "module": finding.module if finding is not None else None})


@contextlib.contextmanager
def tp1_model(ctx: CheckContext, ckpt: Any) -> Iterator[Any]:
    """The architecture's TP=1 model built in this process as a worker builds it (kv_consistency.load_tp1), under a
    CudaGuard: the only build the checker sees happen (the engine's ranks build theirs unguarded, except under
    --enginecheck-strict: cuda_ranks), so one that touches CUDA (strict: queries it) fails here. One intra-op thread,
    the RNG and autograd left as found."""
    import torch

    from pytest_enginecheck.guard import CudaGuard
    from pytest_enginecheck.targets.engine_ref.kv_consistency import load_tp1

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny forwards: one thread is fastest, and steady on a busy machine
    guard = CudaGuard(strict=ctx.options.strict)
    try:
        with torch.random.fork_rng(devices=[]), torch.inference_mode():
            model = load_tp1(ctx.spec, ckpt, SEEDS[0], guard)
            if guard.accesses:
                access = sorted(guard.accesses, key=lambda a: a.kind != "init")[0]
                verb = "queries CUDA" if access.kind == "query" else "touches CUDA"
                raise CheckFailure(f"{ctx.architecture} imports cleanly but {verb} while it is built and loaded: it "
                                   f"{access.describe()}\n{BUILD_CUDA_HINT}",
                                   {**access.to_dict(), "kind": "cuda_build", "access": access.kind})
            yield model
    finally:
        torch.set_num_threads(threads)


def verify_kv_cache(ctx: CheckContext, ckpt: Any, outputs: list[list[int]], model: Any) -> dict[str, Any]:
    """Fail when a token the engine generated with the KV cache is not what ``model`` (``tp1_model``) recomputes
    from its prefix without the cache, or when the engine's scheduler and model runner, driving ``model`` over a KV
    cache on the engine's tokens, give other log-probabilities than that recompute (kv_consistency); return the
    run's detail."""
    from pytest_enginecheck.targets.engine_ref import kv_consistency

    vocab_prompts = [reference_prompt(ckpt, i) for i in range(len(outputs))]
    mismatch = kv_consistency.first_kv_mismatch(model, vocab_prompts, outputs)
    if mismatch is None:
        config = kv_consistency.engine_config(ckpt, SEEDS[0])
        mismatch, largest = kv_consistency.first_cached_difference(model, config, vocab_prompts, outputs)
        if mismatch is None:
            return {"kv_cache_equals_recompute": True, "kv_max_logprob_difference": largest}
    raise CheckFailure(kv_consistency.describe(ctx.architecture, mismatch, vocab_prompts),
                       {"kind": "kv_cache_mismatch", "outputs": outputs, **mismatch})


def run(ctx: CheckContext) -> dict[str, Any]:
    since = time.monotonic()
    ckpt = tiny_checkpoint(ctx, engine_ref_registry(ctx.spec))
    verify_tp(ckpt, ctx.tp)
    try:
        outputs, report = greedy(ctx, ckpt, ctx.tp)
    except CheckFailure as failure:
        if ctx.tp == 1 or failure.detail.get("kind") in cuda_ranks.KINDS:  # a rank touched CUDA: no TP question
            raise
        diagnosis = _diagnosis(ctx, ckpt, reference_prompt(ckpt, DIAGNOSIS_PROMPT), started=False, since=since)
        if diagnosis.module is None:  # the engine's own words stand, with what the diagnosis could say
            raise CheckFailure(f"{failure.message} {diagnosis.text}",
                               {**failure.detail, "diagnosis": diagnosis.text}) from None
        raise CheckFailure(f"{ctx.architecture} fails to start at tensor_parallel_size={ctx.tp}: {diagnosis.text}",
                           {**failure.detail, "kind": "tp_mismatch", "diagnosis": diagnosis.text}) from None
    detail: dict[str, Any] = {
        "tensor_parallel_size": ctx.tp,
        "bytes_read_per_rank": [w.bytes_read for w in report.workers],
        "load_seconds_per_rank": [round(w.phases.get("load_model", 0.0), 4) for w in report.workers],
    }
    if ctx.tp == 1:
        detail.update(verify_deterministic(ctx, ckpt, outputs))
        with tp1_model(ctx, ckpt) as model:  # one guarded build for the KV-cache, reference and checkpoint oracles
            detail.update(verify_kv_cache(ctx, ckpt, outputs, model))
            detail.update(verify_reference(ctx, ckpt, outputs, model))
            detail.update(verify_checkpoint_values(ctx, ckpt, model))
        return detail
    # The TP=1 reference runs under the other seed: equal to TP=N (under the engine's seed), it is also the
    # determinism check's second run, for free. Unequal, TP=1 under the engine's seed tells whether the model
    # (it differs from the other seed's run: nondeterministic) or its tensor parallelism is at fault.
    other_seed, _ = greedy(ctx, ckpt, 1, seed=SEEDS[1])
    reference = other_seed if other_seed == outputs else greedy(ctx, ckpt, 1)[0]
    detail.update(verify_deterministic(ctx, ckpt, reference, again=other_seed))
    mismatched = [i for i, (a, b) in enumerate(zip(outputs, reference, strict=True)) if a != b]
    if mismatched:
        i = mismatched[0]
        diagnosis = _diagnosis(ctx, ckpt, reference_prompt(ckpt, i))
        raise CheckFailure(
            f"At tensor_parallel_size={ctx.tp}, {ctx.architecture} generates different tokens than at "
            f"tensor_parallel_size=1 (prompt {i}: {outputs[i]} vs {reference[i]}). {diagnosis.text}",
            {**detail, "kind": "tp_mismatch", "outputs": outputs, "reference": reference,
             "diagnosis": diagnosis.text})
    detail.update(verify_same_forward(ctx, ckpt, DIAGNOSIS_PROMPT))
    return detail


def verify_reference(ctx: CheckContext, ckpt: Any, outputs: list[list[int]], model: Any) -> dict[str, Any]:
    """Fail when the engine's TP=1 ``model`` (``tp1_model``) and the architecture's reference implementation
    (``reference``) give other log-probabilities on each prompt and the tokens the engine generated for it; return
    the run's detail, whose ``oracle`` says what the model was held to."""
    from pytest_enginecheck.reference import (
        REFERENCE_ATTRIBUTE,
        ReferenceDeclarationError,
        find_reference,
        load_reference,
    )
    from pytest_enginecheck.targets.engine_ref import reference

    try:
        found = find_reference(ctx.architecture, engine_ref_registry(ctx.spec).resolve_model_cls(ctx.architecture))
    except ReferenceDeclarationError as e:
        raise CheckFailure(str(e), {"kind": "reference_declaration", "oracle": "reference"}) from None
    if found is None:
        return {"oracle": "self", "oracle_why": f"transformers has no class {ctx.architecture} and its class declares "
                                                f"no {REFERENCE_ATTRIBUTE}"}
    sequences = [reference_prompt(ckpt, i) + out for i, out in enumerate(outputs)]
    ref = load_reference(found, ckpt)
    disagreement = reference.first_disagreement(model, ref, sequences)
    detail = {"oracle": "reference", "reference": found.name}
    if disagreement is None:
        return detail
    module, compared = reference.first_differing_module(model, ref, sequences[disagreement.sequence])
    prompt_length = len(reference_prompt(ckpt, disagreement.sequence))
    raise CheckFailure(
        reference.describe(ctx.architecture, found, disagreement, module, compared, prompt_length),
        {**detail, "kind": "reference_mismatch", "sequence": disagreement.sequence,
         "position": disagreement.position, "difference": disagreement.difference, "module": module})


def verify_same_forward(ctx: CheckContext, ckpt: Any, i: int) -> dict[str, Any]:
    """Fail when TP=N's greedy tokens equal TP=1's but one hooked prefill of prompt ``i`` does not end in TP=1's
    outputs (the model's own output and its logits, whole on every rank, within tp_compare's float32 tolerance);
    then a second TP=N run tells a nondeterminism at TP=N (``tp_nondeterminism``) from what tp_explain blames on
    the first module that differs. Return the run's detail.

    Equal tokens are a weak oracle for a tiny model, whose output distribution is nearly flat: a sharding bug that
    keeps every greedy token (a shard scaled by 1.01) still changes what the model computes. Only the final outputs
    decide, not every module's: a module whose rank outputs the diagnosis puts back together by their shapes alone
    (a per-head norm over flattened heads) can look different when it is not. Two hooked forwards (TP=1 and TP=N,
    one prompt) cost less than one engine start."""
    import torch

    from pytest_enginecheck.multirank import run_multirank
    from pytest_enginecheck.targets.engine_ref.tp_diagnosis import capture
    from pytest_enginecheck.targets.engine_ref.tp_explain import Diagnosis, explain_rerun, explain_tp
    from pytest_enginecheck.tp_compare import ATOL, RTOL

    prompt, timeout = reference_prompt(ckpt, i), max(10.0, ctx.options.timeout * 0.4)
    try:
        (one,) = run_multirank(capture, 1, ctx.spec, str(ckpt), prompt, timeout=timeout)
        ranks = run_multirank(capture, ctx.tp, ctx.spec, str(ckpt), prompt, timeout=timeout)
    except Exception as e:  # noqa: BLE001 - the tokens agreed; the detail says why the forwards were not compared
        return {"forward_not_compared": f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[-1]}"}
    failed = one.error or next((r.error for r in ranks if r.error is not None), None)
    finals = [k for k in (one.root, one.logits) if k is not None] or one.order[-1:]
    missing = next((k for k in finals if any(k not in r.outputs for r in [one, *ranks])), None)
    if failed is not None or not finals or missing is not None:
        return {"forward_not_compared": f"the hooked forward raised {failed}" if failed else
                f"no rank output of {missing or 'any module'} was captured"}
    differences: dict[str, float] = {}
    for key in finals:
        full, parts = one.outputs[key].float(), [r.outputs[key].float() for r in ranks]
        if any(p.shape != full.shape for p in parts):
            return {"forward_not_compared": f"{key}'s output is not whole on every rank"}
        differences[key] = max(float((p - full).abs().max()) for p in parts) if full.numel() else 0.0
        if not all(torch.allclose(p, full, atol=ATOL, rtol=RTOL) for p in parts):
            break
    else:
        return {"forward_compared": finals, "forward_max_difference": max(differences.values())}
    what = "other logits" if key == one.logits else "other hidden states"
    found = (f"{key}'s output in the prefill of prompt {i} differs by {differences[key]:.3g} (max abs), above the "
             f"tolerance {ATOL:g} + {RTOL:g} |x|")
    try:  # a difference that a second TP=N run does not reproduce is no module's weights or collective
        diagnosis = explain_rerun(ranks, run_multirank(capture, ctx.tp, ctx.spec, str(ckpt), prompt,
                                                       timeout=timeout), ctx.tp)
    except Exception as e:  # noqa: BLE001 - the difference stands; the user learns why no module is blamed
        diagnosis = Diagnosis(f"A second run at tensor_parallel_size={ctx.tp}, to reproduce it, failed "
                              f"({type(e).__name__}), so no module is blamed.")
    if diagnosis is not None and diagnosis.nondeterministic:
        raise tp_nondeterminism(ctx, f"its greedy tokens there equal tensor_parallel_size=1's, but {found}",
                                diagnosis)
    diagnosis = diagnosis or explain_tp(one, ranks, ctx.tp)
    raise CheckFailure(
        f"At tensor_parallel_size={ctx.tp}, {ctx.architecture} generates the same greedy tokens as at "
        f"tensor_parallel_size=1, but {what}: {found}. {diagnosis.text}",
        {"kind": "tp_mismatch", "tensor_parallel_size": ctx.tp, "module": diagnosis.module,
         "forward_max_difference": differences[key], "diagnosis": diagnosis.text})


def reference_prompt(ckpt: Any, i: int) -> list[int]:
    """Prompt ``i`` of the fixed prompts, in the checkpoint's vocabulary (``tiny_engine.checkpoint_prompts``)."""
    return checkpoint_prompts(ckpt)[i]
