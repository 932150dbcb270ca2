"""lora[tp=N] on vLLM: a tiny PEFT adapter through vLLM's own LoRA path (``enable_lora``, ``LoRARequest``; on CPU,
``PunicaWrapperCPU``), against the architecture's reference + PEFT.

The adapter is PEFT's own (``get_peft_model`` on the transformers model that made the tiny checkpoint, A and B
random under a fixed seed, ``save_pretrained``), on every linear projection of the decoder layers that transformers
has as an ``nn.Linear`` outside the MoE experts (``target_modules``; for Llama and Qwen2 attention and MLP), and vLLM
wraps only those (``lora_target_modules``). One vLLM start per TP size generates the fixed prompts with the adapter
and without it (``EngineWork.lora_adapter``).

- every TP size: the adapter changes the output (else vLLM's LoRA layers are not applied);
- TP=1: the base model's and the adapter's greedy tokens and log-probabilities equal the reference's (+ PEFT's
  with the same adapter, ``pytest_enginecheck.lora_reference``), teacher-forced on vLLM's tokens, within
  ORACLE_TOLERANCE; this catches what is wrong at every TP size alike (an adapter applied to the wrong projection).
  The reference is ``find_reference``'s, as load[tp=1]'s: what the class declares (``enginecheck_reference``), else
  transformers' class of the architecture's own name, never a base class's (the checkpoint's maker may be one);
  without one the detail's ``oracle`` is ``self`` and says why;
- TP=N: greedy tokens and log-probabilities with the adapter equal TP=1's within load's LOGPROB_TOLERANCE.

Architectures whose vLLM class does not declare SupportsLoRA skip, as vLLM refuses ``enable_lora`` for them; so
do MoE models where vLLM's CPU backend cannot run them with LoRA on (``moe_lora_limit``), even with an adapter on
attention only (Mixtral).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from pytest_enginecheck.checks import CheckContext, CheckFailure, CheckSkip
from pytest_enginecheck.targets.vllm.checks.load import LOGPROB_TOLERANCE, logprob_difference
from pytest_enginecheck.targets.vllm.checks.reference import ORACLE_TOLERANCE, oracle_difference
from pytest_enginecheck.targets.vllm.checks.steps import (
    engine_checkpoint,
    model_class,
    registry_entry,
    shared_run,
    verify_tp,
)
from pytest_enginecheck.targets.vllm.engine.drive import EngineWork
from pytest_enginecheck.targets.vllm.probe import VllmUnavailable, find

LORA_RANK = 8  # one of vLLM's max_lora_rank values (1, 8, 16, 32, 64, ...)
LORA_ALPHA = 16  # PEFT scales B·A by lora_alpha / r = 2
SEED = 0
LORA_ENGINE_ARGS: dict[str, Any] = {"enable_lora": True, "max_lora_rank": LORA_RANK, "max_loras": 1}
SUPPORTS_LORA = (("vllm.model_executor.models.interfaces", "supports_lora"),)


def target_modules(model: Any) -> list[str]:
    """PEFT's ``target_modules`` for a transformers model: the names of its decoder layers' ``nn.Linear`` leaves,
    outside the MoE experts (routed or shared)."""
    import torch

    return sorted({name.rsplit(".", 1)[-1] for name, module in model.named_modules()
                   if isinstance(module, torch.nn.Linear) and ".layers." in name and "expert" not in name})


@contextlib.contextmanager
def _without_progress_bar() -> Iterator[None]:
    """transformers' progress bars off (their tqdm lock is a named semaphore the check child would leak; see
    ``checkpoints._save_without_progress_bar``)."""
    from transformers.utils import logging as hf_logging

    enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if enabled:
            hf_logging.enable_progress_bar()


def _transformers_model(ckpt: str, architecture: str, model_cls: type) -> Any:
    """The transformers model that made the tiny checkpoint (``hf_class``: of the architecture's name or a base
    class's), the adapter's maker only: its module names are the checkpoint's. Not the oracle (``find_reference``)."""
    import torch

    from pytest_enginecheck.targets.vllm.checkpoints.from_transformers import hf_class

    with _without_progress_bar():
        return hf_class(architecture, model_cls).from_pretrained(ckpt, dtype=torch.float32).eval()


def make_adapter(ckpt: str, architecture: str, model_cls: type, path: Path) -> list[str]:
    """Write PEFT's adapter (rank LORA_RANK, random A and B under SEED) for the tiny checkpoint into ``path``; return
    its target modules. B is random, not PEFT's zeros, so the adapter changes the output."""
    import peft
    import torch

    model = _transformers_model(ckpt, architecture, model_cls)
    targets = target_modules(model)
    if not targets:
        raise CheckSkip(f"transformers' {type(model).__name__} has no nn.Linear projection in its decoder layers "
                        f"outside the MoE experts for a LoRA adapter")
    config = peft.LoraConfig(r=LORA_RANK, lora_alpha=LORA_ALPHA, target_modules=targets, lora_dropout=0.0)
    model = peft.get_peft_model(model, config)
    generator = torch.Generator().manual_seed(SEED)
    with torch.no_grad():
        for name, parameter in sorted(model.named_parameters()):
            if ".lora_A." in name or ".lora_B." in name:  # lora_A: (r, in), lora_B: (out, r)
                parameter.copy_(torch.randn(parameter.shape, generator=generator) / parameter.shape[1] ** 0.5)
    with _without_progress_bar():
        model.save_pretrained(str(path))
    return targets


def tiny_adapter(ctx: CheckContext, ckpt: str, model_cls: type) -> Path:
    """The architecture's tiny adapter under the session's workdir, made once (``checkpoints.made_once``)."""
    from pytest_enginecheck.targets.vllm.checkpoints.tiny import made_once

    return made_once(Path(ctx.workdir) / "vllm-lora" / ctx.architecture, "adapter_config.json",
                     lambda tmp: make_adapter(ckpt, ctx.architecture, model_cls, tmp))


TRITON_MOE = "vllm/model_executor/layers/fused_moe/experts/triton_moe.py"


def moe_lora_limit(failure: CheckFailure) -> str | None:
    """Why an engine failure is vLLM's CPU limit with LoRA on a MoE model, or None. With ``enable_lora``, vLLM 0.32
    picks the Triton MoE experts whatever the model (fused_moe/oracle/unquantized.py: ``is_lora_enabled`` ->
    TRITON), and its CPU backend has no Triton: recognized by the root exception (an AttributeError of a missing
    ``triton.language`` attribute) raised in triton_moe.py itself."""
    from pytest_enginecheck.targets.vllm.limits import raised_in

    trace = str(failure.detail.get("traceback", ""))
    if failure.detail.get("kind") != "engine" or "AttributeError: module 'triton.language' has no attribute" not in \
            failure.message.split("\n", 1)[0]:
        return None
    file, _, _ = raised_in(trace)
    if not file.endswith(TRITON_MOE):
        return None
    return ("with enable_lora, vLLM's fused MoE layers run the Triton experts kernel (fused_moe/experts/"
            "triton_moe.py; vLLM picks it for every MoE model with LoRA on), and vLLM's CPU backend has no Triton")


def _lora_run(ctx: CheckContext, ckpt: str, tp: int, mode: str, engine_args: dict[str, Any], adapter: Path) -> Any:
    """The architecture's LoRA start at ``tp`` (shared by lora[tp=1] and lora[tp=N]); vLLM's CPU MoE + LoRA limit
    (moe_lora_limit) a CheckSkip saying so."""
    try:
        return shared_run(ctx, ckpt, tp, mode, engine_args, kind="lora", work=EngineWork(lora_adapter=str(adapter)))
    except CheckFailure as failure:
        limit = moe_lora_limit(failure)
        if limit is None:
            raise
        raise CheckSkip(f"vLLM's engine cannot run {ctx.architecture} with a LoRA adapter on CPU at "
                        f"tensor_parallel_size={tp}: {limit}") from None


def _supports_lora(model_cls: type) -> bool:
    try:
        supports = find(SUPPORTS_LORA, "the lora check asks whether the class declares SupportsLoRA with")
    except VllmUnavailable:
        return bool(getattr(model_cls, "supports_lora", False))  # the class attribute SupportsLoRA sets
    return bool(supports(model_cls))


def run(ctx: CheckContext, mode: str = "warm") -> dict[str, Any]:
    """lora[tp=N] (see the module docstring)."""
    from pytest_enginecheck.lora_reference import peft_unavailable

    model_cls = model_class(ctx, registry_entry(ctx))
    if not _supports_lora(model_cls):
        raise CheckSkip(f"{ctx.architecture} does not declare SupportsLoRA, so vLLM refuses enable_lora for it")
    missing = peft_unavailable()
    if missing:
        raise CheckSkip(f"the lora check makes its adapter with PEFT and compares with the reference + PEFT, but "
                        f"{missing}")
    ckpt = engine_checkpoint(ctx)
    verify_tp(ckpt, ctx.tp)
    adapter = tiny_adapter(ctx, ckpt, model_cls)
    import json

    targets = json.loads((adapter / "adapter_config.json").read_text())["target_modules"]
    # vLLM wraps only the adapter's modules (lora_target_modules): else it wraps the MoE experts too, whose LoRA
    # kernels are Triton's, which vLLM 0.32's CPU backend does not have.
    engine_args = {**LORA_ENGINE_ARGS, "lora_target_modules": sorted(targets)}
    run = _lora_run(ctx, ckpt, ctx.tp, mode, engine_args, adapter)
    detail: dict[str, Any] = {"tensor_parallel_size": ctx.tp, "max_lora_rank": LORA_RANK, "adapter": str(adapter),
                              "target_modules": sorted(targets),
                              "tokens": run.lora_tokens, "base_tokens": run.tokens, "seconds": run.seconds}
    at = f"{ctx.architecture} at tensor_parallel_size={ctx.tp}"
    if not (run.lora_logprobs and run.logprobs):
        raise CheckSkip(f"vLLM returned no log-probabilities ({run.logprobs_unavailable or 'none returned'}), which "
                        f"the lora check compares")
    applied = (run.lora_tokens != run.tokens
               or logprob_difference(run.lora_logprobs, run.logprobs)[0] > LOGPROB_TOLERANCE)
    if not applied:
        raise CheckFailure(f"{at} generates the same tokens and log-probabilities with a LoRA adapter as without it: "
                           f"vLLM's LoRA layers are not applied. Check that the model calls the layers vLLM's LoRA "
                           f"wraps (their forward), not their weights directly.",
                           {**detail, "kind": "lora_not_applied"})
    if ctx.tp == 1:
        return _against_reference(ctx, ckpt, model_cls, adapter, run, detail)
    reference = _lora_run(ctx, ckpt, 1, mode, engine_args, adapter)
    detail["reference_tokens"] = reference.lora_tokens
    mismatched = [i for i, (a, b) in enumerate(zip(run.lora_tokens, reference.lora_tokens, strict=True)) if a != b]
    if mismatched:
        i = mismatched[0]
        raise CheckFailure(
            f"{at} with a LoRA adapter generates other greedy tokens than at tensor_parallel_size=1 (float32): prompt "
            f"{i}: {run.lora_tokens[i]} vs {reference.lora_tokens[i]}. Without the adapter they agree: the adapter's "
            f"A or B is sharded unlike its base layer (a ...WithLoRA layer's slice_lora_a / slice_lora_b)."
            if run.tokens == reference.tokens else
            f"{at} generates other greedy tokens than at tensor_parallel_size=1 with a LoRA adapter (prompt {i}: "
            f"{run.lora_tokens[i]} vs {reference.lora_tokens[i]}) and without it too: see load[tp={ctx.tp}].",
            {**detail, "kind": "tp_mismatch"})
    difference, i, j = logprob_difference(run.lora_logprobs, reference.lora_logprobs)
    detail.update(max_logprob_difference=difference, logprob_tolerance=LOGPROB_TOLERANCE)
    if difference > LOGPROB_TOLERANCE:
        raise CheckFailure(
            f"{at} with a LoRA adapter generates the same greedy tokens but other log-probabilities than at "
            f"tensor_parallel_size=1 (float32): max difference {difference:.3g} at prompt {i}, generated token "
            f"{j - 1}, above tolerance {LOGPROB_TOLERANCE:g}: the adapter's A or B is sharded unlike its base "
            f"layer, or its partial products are reduced wrongly.", {**detail, "kind": "tp_mismatch"})
    return detail


def _against_reference(ctx: CheckContext, ckpt: str, model_cls: type, adapter: Path, run: Any,
                       detail: dict[str, Any]) -> dict[str, Any]:
    """TP=1: the base model against the architecture's reference (``find_reference``), then the adapter against the
    reference + PEFT's (``lora_reference.load_peft_reference``; ``disable_adapter`` for the base)."""
    from pytest_enginecheck.lora_reference import load_peft_reference, no_reference_why
    from pytest_enginecheck.reference import ReferenceDeclarationError, find_reference

    try:
        found = find_reference(ctx.architecture, model_cls)
    except ReferenceDeclarationError as e:
        raise CheckFailure(str(e), {**detail, "kind": "reference_declaration", "oracle": "reference"}) from None
    if found is None:
        return {**detail, "oracle": "self", "oracle_why": no_reference_why(ctx.architecture)}
    model = load_peft_reference(found, Path(ckpt), adapter)
    with model.disable_adapter():
        base = oracle_difference(model, ckpt, run.tokens, run.logprobs)
    lora = oracle_difference(model, ckpt, run.lora_tokens, run.lora_logprobs)
    detail.update(oracle="reference", reference=found.name, max_base_difference=base[0], max_lora_difference=lora[0],
                  oracle_tolerance=ORACLE_TOLERANCE)
    for (difference, i, k, what), against, kind in ((base, found.name, "base_mismatch"),
                                                    (lora, f"{found.name} with PEFT's adapter", "lora_mismatch")):
        if difference > ORACLE_TOLERANCE:
            which = "without the adapter" if kind == "base_mismatch" else "with a LoRA adapter"
            cause = ("vLLM's model already differs from its reference before any LoRA" if kind == "base_mismatch" else
                     "without it they agree: vLLM applies the adapter unlike PEFT (a module's A and B on another "
                     "projection, a wrong packed slice or scaling)")
            raise CheckFailure(
                f"{ctx.architecture} at tensor_parallel_size=1 {which} differs from {against} (float32, teacher-forced "
                f"on vLLM's tokens): {what} at prompt {i}, generated token {k} differ by {difference:.3g}, above "
                f"tolerance {ORACLE_TOLERANCE:g}; {cause}.", {**detail, "kind": kind, "prompt": i, "position": k})
    return detail
