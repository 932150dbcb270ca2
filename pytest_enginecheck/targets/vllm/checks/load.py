"""load[tp=N] on vLLM: it builds, loads and generates at TP=N, and TP=N agrees with TP=1.
"""

from __future__ import annotations

from typing import Any

from pytest_enginecheck.checks import CheckContext, CheckFailure, CheckSkip
from pytest_enginecheck.targets.vllm.checks.steps import apart, engine_inputs, shared_run, verify_tp
from pytest_enginecheck.targets.vllm.engine.drive import OTHER_SEED, EngineRun
from pytest_enginecheck.targets.vllm.engine.dtype import MLA_DTYPE
from pytest_enginecheck.targets.vllm.env import ENGINE_ARGS


def _diagnosis(ctx: CheckContext, ckpt: str, i: int, mode: str) -> str:
    """Which module of vLLM's model differs first at TP=N on prompt ``i`` (diagnosis.py); run only on a mismatch."""
    from pytest_enginecheck.targets.vllm.checks.diagnosis import diagnose
    from pytest_enginecheck.targets.vllm.engine.drive import checkpoint_prompts

    return diagnose(ckpt, ctx.tp, checkpoint_prompts(ckpt)[i], mode, timeout=max(10.0, ctx.options.timeout * 0.4))


# How far TP=N's log-probabilities may be from TP=1's (float32 CPU). A clean model's differ only by summation order
# (each rank sums its shard, then the all-reduce sums the ranks): measured at TP=2 on the tiny checkpoints, at most
# 9.5e-7 for Llama and Qwen2 and 4.8e-7 for Mixtral, i.e. 1-2 float32 ulps of a log-probability near
# log(1/256) = -5.5. The tolerance sits 100x above that, and 15x below what the subtlest planted sharding bug
# gives (layer 1's o_proj with rank 1's shard scaled by 1.01: 1.6e-3; every greedy token unchanged); a wrong shard
# offset moves them by 1e-2 and more. tests/vllm/test_vllm_soundness.py holds both ends.
LOGPROB_TOLERANCE = 1e-4


def logprob_difference(run: list[list[dict[str, float]]],
                       reference: list[list[dict[str, float]]]) -> tuple[float, int, int]:
    """The largest |log p(TP=N) - log p(TP=1)| over the tokens both runs report at a position, and where:
    (difference, prompt, position in the prompt + generated sequence)."""
    worst = (0.0, 0, 0)
    for i, (got, want) in enumerate(zip(run, reference, strict=True)):
        for j, (a, b) in enumerate(zip(got, want, strict=True), start=1):  # position 0 predicts nothing
            for token in a.keys() & b.keys():  # the actual token is in both, so never empty
                if abs(a[token] - b[token]) > worst[0]:
                    worst = (abs(a[token] - b[token]), i, j)
    return worst


def tp_comparison_skipped(architecture: str, tp: int, dtype: str) -> str | None:
    """Why load[tp=N] does not compare TP=N's tokens and log-probabilities to TP=1's for a model vLLM runs in
    ``dtype`` here, after TP=N built, loaded and generated; None where it compares them (float32)."""
    if dtype == ENGINE_ARGS["dtype"]:
        return None
    return (f"{architecture} built, loaded and generated at tensor_parallel_size={tp} ({dtype}), but its tokens and "
            f"log-probabilities are not compared to tensor_parallel_size=1's: that comparison's bound "
            f"(LOGPROB_TOLERANCE {LOGPROB_TOLERANCE:g}) is derived for float32, and vLLM builds this model with MLA "
            f"attention, whose CPU backend (attention/backends/mla/amx_mla.py) runs only {MLA_DTYPE}, where "
            f"rounding alone can move log-probabilities past that bound and flip near-tie greedy tokens")


def _not_comparable(ckpt: str, run: EngineRun, dtype: str) -> str:
    """Why vLLM's run of ``ckpt`` cannot be held to a reference here ("" where it can)."""
    from pytest_enginecheck.targets.vllm.checkpoints.args import checkpoint_args

    if dtype != ENGINE_ARGS["dtype"]:
        return f"vLLM runs it in {dtype}, and the oracle's bound is derived for float32"
    if checkpoint_args(ckpt).get("language_model_only"):
        return "vLLM runs only its text decoder (a composite checkpoint)"
    return "" if run.logprobs else "vLLM returned no log-probabilities"


def verify_reference(ctx: CheckContext, ckpt: str, run: EngineRun, dtype: str) -> dict[str, Any]:
    """load[tp=1]'s oracle (``reference``): vLLM's log-probabilities on its generated tokens equal those of the
    architecture's reference implementation within ORACLE_TOLERANCE, else a CheckFailure naming where; the detail
    says what the model was held to (``oracle``: ``reference`` and which, or ``none`` and why)."""
    from pathlib import Path

    from pytest_enginecheck.reference import (
        REFERENCE_ATTRIBUTE,
        ReferenceDeclarationError,
        find_reference,
        load_reference,
    )
    from pytest_enginecheck.targets.vllm.checks.reference import ORACLE_TOLERANCE, oracle_difference
    from pytest_enginecheck.targets.vllm.checks.steps import model_class, registry_entry
    from pytest_enginecheck.targets.vllm.engine.drive import checkpoint_prompts

    try:
        found = find_reference(ctx.architecture, model_class(ctx, registry_entry(ctx)))
    except ReferenceDeclarationError as e:
        raise CheckFailure(str(e), {"kind": "reference_declaration", "oracle": "reference"}) from None
    if found is None:
        return {"oracle": "none", "oracle_why": f"transformers has no class {ctx.architecture} and vLLM's class "
                                                f"declares no {REFERENCE_ATTRIBUTE}"}
    why = _not_comparable(ckpt, run, dtype)
    if why:
        return {"oracle": "none", "oracle_why": why}
    try:
        model = load_reference(found, Path(ckpt))
        generated = [positions[len(prompt) - 1:] for prompt, positions in
                     zip(checkpoint_prompts(ckpt), run.logprobs, strict=True)]
        difference, i, k, what = oracle_difference(model, ckpt, run.tokens, generated)
    except Exception as e:  # noqa: BLE001 - the reference's limit on the checker's tiny checkpoint, said so
        return {"oracle": "none", "oracle_why": f"{found.name} cannot run the tiny checkpoint: {type(e).__name__}: "
                                                f"{str(e).splitlines()[0] if str(e) else ''}"}
    detail = {"oracle": "reference", "reference": found.name, "max_reference_difference": difference}
    if difference > ORACLE_TOLERANCE:
        raise CheckFailure(
            f"{ctx.architecture} at tensor_parallel_size=1 does not compute what {found.name} computes on the same "
            f"tiny checkpoint (float32, teacher-forced on vLLM's tokens): {what} at prompt {i}, generated token {k} "
            f"differ by {difference:.3g}, above the tolerance {ORACLE_TOLERANCE:g}. Seeds and TP sizes cannot see "
            f"this: it is the same in every run.", {**detail, "kind": "reference_mismatch", "prompt": i,
                                                    "position": k})
    return detail


def run_load(ctx: CheckContext, mode: str = "warm") -> dict[str, Any]:
    """load[tp=N]: vLLM builds, loads and generates at TP=N, and its greedy tokens equal TP=1's and its
    log-probabilities (top-k of every prompt and generated position) TP=1's within LOGPROB_TOLERANCE (float32).
    A model vLLM runs in bfloat16 (MLA attention, ``engine.engine_dtype``) is not compared: a CheckSkip saying why
    (``tp_comparison_skipped``), once TP=N ran."""
    ckpt, args = apart(ctx, engine_inputs)
    verify_tp(ckpt, ctx.tp)
    run = shared_run(ctx, ckpt, ctx.tp, mode, args)
    dtype = args["dtype"]
    detail = {"tensor_parallel_size": ctx.tp, "dtype": dtype, "tokens": run.tokens, "seconds": run.seconds,
              "start_mode": run.mode}
    detail.update(verify_deterministic(ctx, run, dtype))
    if ctx.tp == 1:
        return {**detail, **verify_reference(ctx, ckpt, run, dtype)}
    skipped = tp_comparison_skipped(ctx.architecture, ctx.tp, dtype)
    if skipped:
        raise CheckSkip(skipped)
    reference = shared_run(ctx, ckpt, 1, mode, args)
    for i, (got, want) in enumerate(zip(run.tokens, reference.tokens, strict=True)):
        if got != want:
            position = next((j for j, (a, b) in enumerate(zip(got, want, strict=False)) if a != b),
                            min(len(got), len(want)))
            diagnosis = _diagnosis(ctx, ckpt, i, mode)
            raise CheckFailure(
                f"{ctx.architecture} at tensor_parallel_size={ctx.tp} generates other greedy tokens than at "
                f"tensor_parallel_size=1 ({dtype}): prompt {i} differs from token {position} on (TP={ctx.tp}: {got}, "
                f"TP=1: {want}). "
                f"{diagnosis}",
                {**detail, "kind": "tp_mismatch", "reference_tokens": reference.tokens, "diagnosis": diagnosis})
    if not (run.logprobs and reference.logprobs):
        detail["logprobs_not_compared"] = run.logprobs_unavailable or reference.logprobs_unavailable or "none returned"
        return detail
    difference, i, j = logprob_difference(run.logprobs, reference.logprobs)
    detail.update(max_logprob_difference=difference, logprob_tolerance=LOGPROB_TOLERANCE)
    if difference > LOGPROB_TOLERANCE:
        diagnosis = _diagnosis(ctx, ckpt, i, mode)
        prompt_length = len(reference.logprobs[i]) + 1 - len(reference.tokens[i])
        where = "a prompt token" if j < prompt_length else f"generated token {j - prompt_length}"
        raise CheckFailure(
            f"{ctx.architecture} at tensor_parallel_size={ctx.tp} generates the same greedy tokens but other "
            f"log-probabilities than at tensor_parallel_size=1 ({dtype}): max difference {difference:.3g} at prompt "
            f"{i}, position {j} ({where}), above tolerance {LOGPROB_TOLERANCE:g}. {diagnosis}",
            {**detail, "kind": "tp_mismatch", "prompt": i, "position": j, "diagnosis": diagnosis})
    return detail


def verify_deterministic(ctx: CheckContext, run: EngineRun, dtype: str) -> dict[str, Any]:
    """Fail when the engine, generating the same prompts again after every worker reseeded torch (drive's
    determinism run), gives other tokens, or generated tokens' log-probabilities further apart than
    LOGPROB_TOLERANCE (the second prefill may start from vLLM's prefix cache, so not bit for bit); return the detail.
    In float32 only: a bfloat16 model's near ties may flip on the cache's other path."""
    seeds = [ENGINE_ARGS["seed"], OTHER_SEED]
    if not run.tokens_other_seed or dtype != "float32":
        return {"determinism_not_compared": "no second run" if not run.tokens_other_seed else f"{dtype} run"}
    difference = 0.0
    for first, again, tokens in zip(run.logprobs, run.logprobs_other_seed, run.tokens, strict=False):
        for a, b in zip(first[-len(tokens):], again, strict=False):
            difference = max([difference, *(abs(a[k] - b[k]) for k in a.keys() & b.keys())])
    changed = [i for i, (a, b) in enumerate(zip(run.tokens, run.tokens_other_seed, strict=True)) if a != b]
    if not changed and difference <= LOGPROB_TOLERANCE:
        return {"deterministic_seeds": seeds, "max_seed_difference": difference}
    what = (f"other greedy tokens (prompt {changed[0]}: {run.tokens[changed[0]]} vs "
            f"{run.tokens_other_seed[changed[0]]})" if changed else
            f"the same tokens with log-probabilities {difference:.3g} apart, above {LOGPROB_TOLERANCE:g}")
    raise CheckFailure(
        f"{ctx.architecture} is nondeterministic at tensor_parallel_size={ctx.tp} ({dtype}): the same engine, "
        f"generating the same prompts again after torch was reseeded ({seeds[0]}, then {seeds[1]}), gives {what}. "
        f"Its output must not depend on torch's random generators (dropout left in training mode, torch.randn in "
        f"forward, a weight drawn after loading); neither the reference nor TP sizes were compared.",
        {"kind": "nondeterministic", "seeds": seeds, "tokens": run.tokens, "tokens_other_seed": run.tokens_other_seed,
         "max_seed_difference": difference})
