"""lora[tp=1]'s reference oracle: the engine's model with the adapter against the architecture's reference
implementation with PEFT's, on the same tiny checkpoint and adapter.

With vs without the adapter and TP=N vs TP=1 hold the LoRA path to itself, so one target module whose adapter is
never applied (at every TP size alike) passes them. Here the engine's TP=1 model, built and loaded as a worker does
with its LoRA layers wrapped as the worker's LoRAModelManager wraps them, and the reference
(``pytest_enginecheck.reference.find_reference``'s: what the class declares, else transformers' class of the
architecture's own name) with the adapter loaded by PEFT (``lora_reference``) run each prompt and the tokens the
engine generated for it, in float32, with the adapter and without it (PEFT's ``disable_adapter``). Their
log-probabilities must agree within LORA_LOGPROB_TOLERANCE at every position, and every token the engine generated
must be the reference's greedy choice (or within the tolerance of it).

On a disagreement with the adapter, both run once more hooked (``reference.first_differing_module``), each LoRA
target compared under PEFT's name through an ``Alias`` (a packed layer's columns: ``q_proj`` in ``qkv_proj``),
and the first module whose input agrees and whose output does not is named, with whether its LoRA wrapper ran.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pytest_enginecheck.checks import CheckContext, CheckFailure, CheckSkip
from pytest_enginecheck.reference import Reference
from pytest_enginecheck.targets.engine_ref.reference import LOGPROB_TOLERANCE, Alias, Disagreement

# The engine's LoRA product (x A^T, then B pre-scaled) and PEFT's (B(A(x)) * scaling) differ only in rounding:
# measured on the bundled zoo's tiny checkpoints with lora_check's adapter (rank 8, every target module), on the
# engine's sequences, at most 4.3e-6 in log-probability without the adapter and 3.3e-6 with it (Qwen3-MoE; 0 for
# Llama, Qwen2 and Mixtral), while the adapter moves them by up to 5.1: the results' max_base_difference and
# max_lora_difference (`pytest --enginecheck -m enginecheck --enginecheck-checks=lora --enginecheck-json=PATH`).
# The tolerance is load's, 23x above the largest; the planted bypass of one adapter (tests/plugin_zoo/zoo/
# lora_bypass.py: layer 1's down_proj) differs by 1.26 at its first position.
LORA_LOGPROB_TOLERANCE = LOGPROB_TOLERANCE


@dataclass
class _Switch:
    """Whether the in-process model runs its adapter: before every forward, the pre-hook points its LoRA layers at
    the adapter's slot (or at none), as the worker's model runner does per batch."""

    manager: Any  # engine_ref's LoRAModelManager
    request: Any  # the LoRARequest
    on: bool = True

    def __call__(self, module: Any, args: tuple[Any, ...]) -> None:
        self.manager.set_active_adapters([self.request if self.on else None], [len(args[0])])


def find_lora_reference(ctx: CheckContext, model_cls: type) -> tuple[Reference | None, str]:
    """The architecture's reference, or None and why there is none. A CheckSkip saying what to
    install where peft cannot be imported; a CheckFailure for a declaration that does not resolve."""
    from pytest_enginecheck.lora_reference import no_reference_why, peft_unavailable
    from pytest_enginecheck.reference import ReferenceDeclarationError, find_reference

    try:
        found = find_reference(ctx.architecture, model_cls)
    except ReferenceDeclarationError as e:
        raise CheckFailure(str(e), {"kind": "reference_declaration", "oracle": "reference"}) from None
    if found is None:
        return None, no_reference_why(ctx.architecture)
    missing = peft_unavailable()
    if missing:
        raise CheckSkip(f"lora[tp=1] compares {ctx.architecture} with its reference + PEFT on the same adapter, "
                        f"but {missing}")
    return found, ""


@contextlib.contextmanager
def lora_tp1_model(ctx: CheckContext, ckpt: Path, adapter: Path, max_lora_rank: int) -> Iterator[tuple[Any, Any]]:
    """The TP=1 model (``load_check.tp1_model``: guarded, built as a worker builds it) with its LoRA layers wrapped
    by a LoRAModelManager and the adapter at ``adapter`` in a slot; and its switch (``on``: with the adapter)."""
    from engine_ref.lora.config import LoRAConfig
    from engine_ref.lora.models import LoRAModelManager
    from engine_ref.lora.request import LoRARequest
    from pytest_enginecheck.targets.engine_ref.load_check import tp1_model

    with tp1_model(ctx, ckpt) as model:
        dtype = next(model.parameters()).dtype
        manager = LoRAModelManager(model, LoRAConfig(max_lora_rank=max_lora_rank), str(ckpt), dtype)
        switch = _Switch(manager, LoRARequest("enginecheck", 1, str(adapter)))
        handle = model.register_forward_pre_hook(switch)
        try:
            yield model, switch
        finally:
            handle.remove()


def compare(model: Any, ref: Any, sequences: list[list[int]], prompts: list[list[int]]
            ) -> tuple[Disagreement | None, float, tuple[int, int, int, int, float] | None]:
    """The first position where the two models' log-probabilities differ by more than LORA_LOGPROB_TOLERANCE (None:
    nowhere), the largest difference, and the first generated token that is not the reference's greedy choice by
    more than the tolerance: (sequence, generated token, token, the reference's choice, shortfall), or None."""
    from pytest_enginecheck.targets.engine_ref.reference import engine_logprobs, reference_logprobs

    first: tuple[int, int, float] | None = None
    shortfall: tuple[int, int, int, int, float] | None = None
    largest = 0.0
    for i, (tokens, prompt) in enumerate(zip(sequences, prompts, strict=True)):
        ours, theirs = engine_logprobs(model, tokens), reference_logprobs(ref, tokens)
        vocab = min(ours.shape[-1], theirs.shape[-1])
        per_position = (ours[:, :vocab] - theirs[:, :vocab]).abs().amax(dim=-1)
        largest = max(largest, float(per_position.max()))
        over = (per_position > LORA_LOGPROB_TOLERANCE).nonzero()
        if first is None and len(over):
            first = (i, int(over[0, 0]), float(per_position[int(over[0, 0])]))
        for k, token in enumerate(tokens[len(prompt):]):
            row = theirs[len(prompt) - 1 + k]  # the position that predicts generated token k
            short = float(row.max() - row[token])
            if shortfall is None and short > LORA_LOGPROB_TOLERANCE:
                shortfall = (i, k, token, int(row.argmax()), short)
    return (None if first is None else Disagreement(*first, largest)), largest, shortfall


def lora_aliases(manager: Any) -> dict[str, Alias]:
    """Every LoRA target of the manager's model under PEFT's name: its ``...WithLoRA`` layer, else the base layer in
    it, and the columns of its sub-projection (TP=1)."""
    aliases = {}
    for peft_name, (module, shard_id) in manager.targets.items():
        offset, size, _ = manager.modules[module].base_layer.output_shard(shard_id)
        aliases[peft_name] = Alias((module, f"{module}.base_layer"), (offset, offset + size))
    return aliases


def wrappers_not_called(model: Any, tokens: list[int]) -> list[str]:
    """The ``...WithLoRA`` layers a forward of ``tokens`` did not call while it called the base layer they wrap."""
    from engine_ref.lora.layers import BaseLinearLayerWithLoRA
    from pytest_enginecheck.targets.engine_ref.reference import engine_logprobs

    called: set[str] = set()
    handles = []
    for name, module in model.named_modules():
        if isinstance(module, BaseLinearLayerWithLoRA):
            for each, key in ((module, name), (module.base_layer, f"{name}.base_layer")):
                handles.append(each.register_forward_hook(lambda *_, key=key: called.add(key)))
    try:
        engine_logprobs(model, tokens)
    finally:
        for handle in handles:
            handle.remove()
    return sorted(name.removesuffix(".base_layer") for name in called
                  if name.endswith(".base_layer") and name.removesuffix(".base_layer") not in called)


def verify_reference(ctx: CheckContext, ckpt: Path, adapter: Path, reference: Reference, outputs: list[list[int]],
                     base_outputs: list[list[int]], max_lora_rank: int) -> dict[str, Any]:
    """Fail when the engine's TP=1 model and ``reference`` + PEFT (``find_lora_reference``'s) give
    other log-probabilities on each prompt and the tokens the engine generated for it, with the adapter
    (``outputs``) or without it (``base_outputs``), or a generated token is not the reference's greedy choice;
    return the run's detail (``oracle``: ``reference`` and which)."""
    from pytest_enginecheck.lora_reference import load_peft_reference
    from pytest_enginecheck.targets.engine_ref.load_check import reference_prompt
    from pytest_enginecheck.targets.engine_ref.reference import first_differing_module

    prompts = [reference_prompt(ckpt, i) for i in range(len(outputs))]
    detail: dict[str, Any] = {"oracle": "reference", "reference": reference.name,
                              "logprob_tolerance": LORA_LOGPROB_TOLERANCE}
    peft_model = load_peft_reference(reference, ckpt, adapter)
    ref = peft_model.get_base_model()  # the reference's module names, PEFT's LoRA layers in place
    with lora_tp1_model(ctx, ckpt, adapter, max_lora_rank) as (model, switch):
        switch.on = False
        with peft_model.disable_adapter():
            base, detail["max_base_difference"], base_short = compare(
                model, ref, [p + o for p, o in zip(prompts, base_outputs, strict=True)], prompts)
        where = _where(base, base_short, prompts)
        if where:
            raise CheckFailure(
                f"{ctx.architecture} at tensor_parallel_size=1 without its LoRA adapter already differs from "
                f"{reference.name} on the same tiny checkpoint (float32): {where}. See load[tp=1], which holds the "
                f"model to it.", {**detail, "kind": "reference_mismatch"})
        switch.on = True
        sequences = [p + o for p, o in zip(prompts, outputs, strict=True)]
        lora, detail["max_lora_difference"], short = compare(model, ref, sequences, prompts)
        where = _where(lora, short, prompts)
        if not where:
            return detail
        module, compared, skipped = None, 0, []
        if lora is not None:
            module, compared = first_differing_module(model, ref, sequences[lora.sequence],
                                                      lora_aliases(switch.manager))
            skipped = wrappers_not_called(model, sequences[lora.sequence])
        raise CheckFailure(
            f"{ctx.architecture} at tensor_parallel_size=1 with a LoRA adapter does not compute what {reference.name} "
            f"with PEFT's adapter computes on the same tiny checkpoint and adapter (float32), while without the "
            f"adapter they agree: {where}." + (f" It is the same at every TP size, so TP=N against TP=1 cannot see "
                                                f"it. {_module(reference, module, compared, switch.manager, skipped)}"
                                                if lora is not None else ""),
            {**detail, "kind": "lora_mismatch", "module": module, "lora_layers_not_called": skipped,
             **({"sequence": lora.sequence, "position": lora.position, "difference": lora.difference}
                if lora is not None else {})})


def _where(found: Disagreement | None, short: tuple[int, int, int, int, float] | None,
           prompts: list[list[int]]) -> str:
    """Where the engine's output left the reference's, in words ("" where it did not)."""
    if found is not None:
        length = len(prompts[found.sequence])
        where = (f"prompt token {found.position}" if found.position < length else
                 f"generated token {found.position - length}")
        return (f"on sequence {found.sequence}, its log-probabilities after {where} (position {found.position}) "
                f"differ by {found.difference:.3g}, above the tolerance {LORA_LOGPROB_TOLERANCE:g} (largest "
                f"difference {found.largest:.3g})")
    if short is None:
        return ""
    i, k, token, best, shortfall = short
    return (f"the engine generated token {token} as generated token {k} of prompt {i}, which the reference finds "
            f"{shortfall:.3g} less likely than its greedy choice {best} (above the tolerance "
            f"{LORA_LOGPROB_TOLERANCE:g}), while the model rebuilt in this process agrees with the reference "
            f"everywhere: the engine's own run differs (the KV cache, or its batch's LoRA mapping)")


def _module(reference: Reference, module: str | None, compared: int, manager: Any, skipped: list[str]) -> str:
    """The module where the two computations part, in words, and the LoRA layers the forward did not call."""
    others = (f" LoRA layers the forward did not call (it called the base layer they wrap): {', '.join(skipped)}."
              if skipped else "")
    if module is None:
        return (f"Of the {compared} modules compared, none's output differs where its input agrees.{others}"
                if compared else f"The two models name no module alike, so no module is named.{others}")
    if module not in manager.targets:
        return (f"The first module whose input agrees with {reference.name}'s and whose output does not is {module}: "
                f"open its code.{others}")
    engine_module, shard_id = manager.targets[module]
    layer = f"engine_ref's {engine_module}" + (f", sub-projection {shard_id!r}" if shard_id is not None else "")
    first = (f"The first module whose input agrees with {reference.name}'s and whose output does not is the LoRA "
             f"target {module} ({layer}, a {type(manager.modules[engine_module]).__name__})")
    if engine_module in skipped:
        rest = [name for name in skipped if name != engine_module]
        return (f"{first}: its LoRA layer was never called, only the base layer it wraps, so its adapter is silently "
                f"skipped. The model reaches that layer another way than through the attribute LoRA replaced (a "
                f"handle taken before the engine wrapped it, or its base_layer)."
                + (f" Also not called: {', '.join(rest)}." if rest else ""))
    return (f"{first}: its LoRA layer ran and adds another product than PEFT's (its A and B, the scaling "
            f"lora_alpha / r, or the rows of its sub-projection: output_shard).{others}")
