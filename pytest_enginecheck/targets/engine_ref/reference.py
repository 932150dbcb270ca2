"""load[tp=1]'s reference oracle: the engine's model against an implementation this project did not write.

Every other comparison of the load check holds the model to itself (two seeds, the KV cache against recomputing,
TP=N against TP=1), so a bug that is the same in every run passes them. Here the engine's TP=1 model (built and
loaded as a worker does) and a reference implementation of the same architecture, loaded from the same tiny
checkpoint, run the same token sequences (each prompt and the tokens the engine generated for it) in float32, and
their log-probabilities at every position must agree within LOGPROB_TOLERANCE.

The reference is ``pytest_enginecheck.reference.find_reference``'s: what the model class declares
(``enginecheck_reference``), else transformers' class of the architecture's own name; without one, the
architecture is held to self-consistency only, and its result says so (``oracle``).

On a disagreement, both models are run once more with a hook on every module whose name they share (engine_ref
keeps Hugging Face's module names) and the first module whose input agrees and whose output does not is named:
the module where the two computations part. vLLM's residual-stream convention (a decoder layer or a fused norm
returning ``(hidden_states, residual)``) is matched by comparing the sum of the returned tensors too. A module the
reference names and the engine computes under another name (a LoRA target inside a packed layer: PEFT's ``q_proj``,
columns of engine_ref's ``qkv_proj``) is compared through an ``Alias``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pytest_enginecheck.reference import Reference

# Two correct float32 implementations differ only in the order of their sums: measured on the bundled zoo's tiny
# checkpoints at most 4.3e-6 (Qwen3-MoE; 0 for the others), in log-probability at any position and token of the load
# check's sequences, up to max_model_len (benchmarks/reference_oracle.py prints it). The tolerance is 23x that, and
# 4,500x below the smallest largest difference of tests/plugin_zoo/zoo/planted_reference.py's bugs (GELU in place of
# SiLU in layer 1: 0.46).
LOGPROB_TOLERANCE = 1e-4
MODULE_ATOL, MODULE_RTOL = 1e-4, 1e-3  # a hooked module's output, as the TP diagnosis compares them


@dataclass(frozen=True)
class Disagreement:
    """Where the engine's log-probabilities left the reference's: the sequence, its position, by how much."""

    sequence: int
    position: int
    difference: float
    largest: float  # over every position of every sequence compared


@dataclass(frozen=True)
class Alias:
    """Where the engine computes a module the reference names: the first of ``modules`` its forward called (a LoRA
    wrapper, else the layer it wraps), its output columns (start, stop) where it packs several (None: all)."""

    modules: tuple[str, ...]
    columns: tuple[int, int] | None = None


def engine_logprobs(model: Any, tokens: list[int]) -> Any:
    """The engine model's log-probabilities at every position of ``tokens``, in one forward without a KV cache."""
    import torch

    from engine_ref.model_executor.forward_context import AttentionMetadata, set_forward_context

    input_ids = torch.tensor(tokens, dtype=torch.long)
    with set_forward_context(AttentionMetadata(query_start_loc=[0, len(tokens)], seq_lens=[len(tokens)])):
        hidden_states = model(input_ids, torch.arange(len(tokens)))
    return torch.log_softmax(model.compute_logits(hidden_states).float(), dim=-1)


def reference_logprobs(model: Any, tokens: list[int]) -> Any:
    """The reference's log-probabilities at every position of ``tokens``."""
    import torch

    logits = model(input_ids=torch.tensor([tokens], dtype=torch.long)).logits[0]
    return torch.log_softmax(logits.float(), dim=-1)


def first_disagreement(model: Any, ref: Any, sequences: list[list[int]]) -> Disagreement | None:
    """None when the two models' log-probabilities agree within LOGPROB_TOLERANCE at every position of every
    sequence (over the reference's vocabulary); else the first position where they do not."""
    first: tuple[int, int, float] | None = None
    largest = 0.0
    for i, tokens in enumerate(sequences):
        ours, theirs = engine_logprobs(model, tokens), reference_logprobs(ref, tokens)
        vocab = min(ours.shape[-1], theirs.shape[-1])
        per_position = (ours[:, :vocab] - theirs[:, :vocab]).abs().amax(dim=-1)
        largest = max(largest, float(per_position.max()))
        over = (per_position > LOGPROB_TOLERANCE).nonzero()
        if first is None and len(over):
            position = int(over[0, 0])
            first = (i, position, float(per_position[position]))
    return None if first is None else Disagreement(*first, largest)


def _float_tensors(args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[Any]:
    import torch

    values = [*args, *kwargs.values()]
    return [v for v in values if isinstance(v, torch.Tensor) and v.is_floating_point()]


def _readings(values: list[Any]) -> list[Any]:
    """What a hooked call's tensors are compared by: the first one, and the sum of those of its shape (a decoder
    layer or fused norm of the residual-stream convention returns ``(hidden_states, residual)``)."""
    if not values:
        return []
    same = [v for v in values if v.shape == values[0].shape]
    return [values[0]] + ([sum(same[1:], same[0])] if len(same) > 1 else [])


class _Recorder:
    """Forward hooks on the named modules: each one's first call, its input and output readings (detached)."""

    def __init__(self, model: Any, names: set[str]) -> None:
        self.order: list[str] = []
        self.inputs: dict[str, list[Any]] = {}
        self.outputs: dict[str, list[Any]] = {}
        self._handles = []
        for name, module in model.named_modules():
            if name in names:
                self._handles.append(module.register_forward_pre_hook(self._enter(name), with_kwargs=True))
                self._handles.append(module.register_forward_hook(self._leave(name)))

    def _enter(self, name: str) -> Any:
        def hook(module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            self.inputs.setdefault(name, [t.detach().clone() for t in _readings(_float_tensors(args, kwargs))])
        return hook

    def _leave(self, name: str) -> Any:
        def hook(module: Any, args: tuple[Any, ...], output: Any) -> None:
            if name in self.outputs:
                return
            values = list(output) if isinstance(output, (tuple, list)) else [output]
            self.outputs[name] = [t.detach().clone() for t in _readings(_float_tensors(tuple(values), {}))]
            self.order.append(name)
        return hook

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()


def _agree(ours: list[Any], theirs: list[Any]) -> bool | None:
    """Whether some reading of the engine's equals the reference's first (None: nothing comparable)."""
    import torch

    if not ours or not theirs:
        return None
    want = theirs[0].reshape(-1, theirs[0].shape[-1]) if theirs[0].dim() else theirs[0]
    comparable = [o.reshape(want.shape) for o in ours if o.numel() == want.numel()]
    if not comparable:
        return None
    return any(torch.allclose(o.float(), want.float(), atol=MODULE_ATOL, rtol=MODULE_RTOL) for o in comparable)


def _ours(recorder: _Recorder, name: str, alias: Alias | None) -> tuple[list[Any], list[Any]] | None:
    """The engine's input and output readings of the reference's module ``name`` (through ``alias``), or None where
    the engine's forward did not call it."""
    called = next((m for m in alias.modules if m in recorder.outputs), None) if alias is not None else \
        name if name in recorder.outputs else None
    if called is None:
        return None
    outputs = recorder.outputs[called]
    if alias is not None and alias.columns is not None:
        start, stop = alias.columns
        outputs = [o[..., start:stop] for o in outputs]
    return recorder.inputs.get(called, []), outputs


def first_differing_module(model: Any, ref: Any, tokens: list[int], aliases: Mapping[str, Alias] | None = None
                           ) -> tuple[str | None, int]:
    """The first module (in the order the reference's calls finish) whose input agrees with the reference's and
    whose output does not, over one run of ``tokens``; and how many modules were compared. ``aliases``: the
    reference's modules the engine computes elsewhere (their names are the reference's)."""
    aliases = aliases or {}
    ref_names = {name for name, _ in ref.named_modules()} - {""}
    shared = ({name for name, _ in model.named_modules()} | aliases.keys()) & ref_names
    ours = _Recorder(model, shared | {module for alias in aliases.values() for module in alias.modules})
    theirs = _Recorder(ref, shared)
    try:
        engine_logprobs(model, tokens)
        reference_logprobs(ref, tokens)
    finally:
        ours.remove()
        theirs.remove()
    readings = {name: _ours(ours, name, aliases.get(name)) for name in theirs.order}
    compared = [name for name in theirs.order if readings[name] is not None]
    for name in compared:
        inputs, outputs = readings[name] or ([], [])
        if _agree(outputs, theirs.outputs[name]) is False and _agree(inputs, theirs.inputs.get(name, [])):
            return name, len(compared)
    return None, len(compared)


def describe(architecture: str, reference: Reference, found: Disagreement, module: str | None, compared: int,
             prompt_length: int) -> str:
    """The disagreement in words: where the engine's output left the reference's, by how much, and where to look."""
    where = (f"prompt token {found.position}" if found.position < prompt_length else
             f"generated token {found.position - prompt_length}")
    at = (f"The first module whose input agrees with {reference.name}'s and whose output does not is {module}: "
          f"open its code (and the weights its load_weights gives it)." if module is not None else
          f"Of the {compared} modules both name alike, none's output differs where its input agrees: the logits "
          f"part after them (compute_logits, lm_head: is it tied as config.json's tie_word_embeddings says?)"
          if compared else "The two models name no module alike, so no module is named.")
    return (f"{architecture} at tensor_parallel_size=1 does not compute what {reference.name} computes on the same "
            f"tiny checkpoint (float32): on sequence {found.sequence}, its log-probabilities after {where} (position "
            f"{found.position}) differ by {found.difference:.3g}, above the tolerance {LOGPROB_TOLERANCE:g} (largest "
            f"difference {found.largest:.3g}). Seeds, the KV cache and TP sizes cannot see this: it is the same in "
            f"every run. {at}")
