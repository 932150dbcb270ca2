"""When two runs of a model disagree: name the first module whose output differs, and say why.

Each run is a Capture, filled by forward hooks on every module (tp_diagnosis.capture), the model's own output and
its logits (compute_logits) included: at TP=1 and on N ranks, at TP=1 under two seeds, or twice at TP=N (a TP=N
run that its own rerun does not reproduce is nondeterministic there, whatever its weights and collectives). The
runs' outputs are compared in the order the modules finished (innermost first); for TP, each rank's outputs and
weights are first put back together with the layer's own sharding (``output_shard`` rows for column-parallel
layers, ``input_start`` columns for row-parallel ones). The first TP module that differs is either a sharding bug
(its weights do not reassemble to TP=1's) or a collective bug (they do, its output does not); the logits, where
the model's output agrees, are compute_logits' own. A forward that fails at TP=N names the module it failed in and,
for a linear layer, whether its input arrived sharded or whole, which says which parallel style it needs. A module
whose outputs cannot be compared is named as such, never skipped.

The comparison (``compare``, ``reassemble``, ``weights_problem``, ``failed_forward``, ``explain_tp``,
``explain_seeds``, ``explain_rerun``) reads only Captures (tensors, and the layers' sharding as plain data) and
imports no engine: another target's hooks can fill Captures and reuse it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from pytest_enginecheck.tp_compare import ATOL, RTOL, join_split, loaded_by, max_abs_diff, module_name
from pytest_enginecheck.tp_compare import close as _close

# ATOL, RTOL: TP=N against TP=1 (other reduction orders); two seeds at TP=1 must agree exactly (atol=rtol=0).


@dataclass
class Capture:
    """One rank's run: per module call (in the order they finished) its output, input shape and sharding.

    A key is the module's name, ``name (call 2)`` for its later calls (a module shared by the layers).
    ``layouts`` (linear layers only): ``{"column": bool`` (the output is sharded), ``"input_start": int | None``
    (a row-parallel rank's first input column), ``"shards": {shard_id: (offset in this rank's output, size,
    start in the TP=1 shard)}}``. ``params``: a module's own ``weight`` and ``bias``; ``loaders``: the weight loaders
    of its own parameters (``tp_compare.weight_loaders``). ``root`` and ``logits``: the keys of the model's own output
    (after its last submodule) and of its logits, compared like every module's (None where a target has none).
    """

    order: list[str] = field(default_factory=list)
    outputs: dict[str, Any] = field(default_factory=dict)
    unreadable: dict[str, str] = field(default_factory=dict)  # key -> type of an output that holds no tensor
    input_shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)
    classes: dict[str, str] = field(default_factory=dict)
    layouts: dict[str, dict[str, Any]] = field(default_factory=dict)  # linear layers' sharding
    params: dict[str, dict[str, Any]] = field(default_factory=dict)  # module -> its own weight/bias
    loaders: dict[str, list[str]] = field(default_factory=dict)  # module -> "qualname (file:line)" of its loaders
    failed_in: str | None = None  # the innermost module running when the forward raised
    error: str | None = None
    root: str | None = None
    logits: str | None = None


@dataclass(frozen=True)
class Comparison:
    """What walking the reference run's modules in finish order found (``compare``)."""

    differs: str | None = None  # the first module call whose output differs
    max_abs_diff: float = 0.0  # of that output; inf when its shape differs
    uncomparable: tuple[tuple[str, str], ...] = ()  # (key, why) of the calls before it that could not be compared
    failed: str | None = None  # the module call a run's forward failed in (the walk stops there)


@dataclass(frozen=True)
class Diagnosis:
    """The sentences for the user, and the module call they name first (None when they name none);
    ``nondeterministic``: two runs at the same TP size disagree (``explain_rerun``), so no TP size was compared."""

    text: str
    module: str | None = None
    nondeterministic: bool = False


def reassemble(full: Any, parts: list[Any], layouts: list[dict[str, Any] | None] | None, full_layout: Any,
               dim: int) -> tuple[Any, str]:
    """The reference tensor ``full`` rebuilt from the ranks' ``parts``, and ``""``; or None and why it cannot be.

    Whole on every rank: rank 0's part. A column-parallel linear layer (``layouts``, ``full_layout``): rows by
    the layer's shards. Otherwise parts split along their one short dimension are joined in rank order.
    """
    import torch

    shapes = [tuple(p.shape) for p in parts]
    if all(p.shape == full.shape for p in parts):
        return parts[0], ""
    if any(p.dim() != full.dim() for p in parts):
        return None, f"its outputs there have shapes {shapes}, another number of dimensions than {tuple(full.shape)}"
    dim = dim % full.dim()
    if layouts is not None and full_layout is not None and all(layouts) and layouts[0]["column"]:  # type: ignore[index]
        out = torch.full_like(full, float("nan"))
        try:
            for part, layout in zip(parts, layouts, strict=True):
                for sid, (offset, size, start) in layout["shards"].items():  # type: ignore[index]
                    base = full_layout["shards"][sid][0]
                    out.narrow(dim, base + start, size).copy_(part.narrow(dim, offset, size))
        except (RuntimeError, IndexError, KeyError) as e:
            return None, f"its outputs there (shapes {shapes}) do not fit its declared column shards ({e})"
        return out, ""
    joined = join_split(full, parts)  # sharded along its one short dimension, in rank order
    if joined is not None:
        return joined[0], ""
    return None, (f"its outputs there (shapes {shapes}) cannot be put back together into its reference output "
                  f"{tuple(full.shape)}: they are neither whole on every rank nor split along one dimension")


def compare(reference: Capture, runs: list[Capture], names: Sequence[str] | None = None, atol: float = ATOL,
            rtol: float = RTOL, sharded: bool = True) -> Comparison:
    """Walk ``reference``'s module calls in finish order: the first whose output in ``runs`` differs, the calls
    before it that could not be compared, or the call a run's forward failed in.

    ``runs``: the ranks of a TP=N run (``sharded``: their outputs are put back together, ``reassemble``), or
    other whole runs (not ``sharded``: a shape that differs is a difference). ``names``: what to call each run in
    the reasons given (default ``rank 0``, ``rank 1``, ...).
    """
    names = list(names) if names is not None else [f"rank {i}" for i in range(len(runs))]
    failed = next((r.failed_in for r in runs if r.failed_in is not None), None)
    uncomparable: list[tuple[str, str]] = []
    # A call that cannot be compared does not stop the walk: the calls after it are compared as usual, so a
    # definite difference later is still found (and reported after it, qualified). Stopping there would leave
    # the user nothing but "cannot tell"; skipping it silently (as before) blamed the later module alone, when
    # the uncomparable one may be where the runs first differ. The user reads both, in the order they ran.
    for key in reference.order:
        if key == failed:
            return Comparison(uncomparable=tuple(uncomparable), failed=key)
        if key in reference.unreadable:
            uncomparable.append((key, f"its output is a {reference.unreadable[key]}, which holds no tensor (the "
                                      f"diagnosis reads a tensor, or the first tensor of a tuple or list)"))
            continue
        absent = next(((n, r) for n, r in zip(names, runs, strict=True) if key not in r.outputs), None)
        if absent is not None:
            run_name, run = absent
            if key not in run.unreadable and failed is not None:  # it would have run after the failure
                return Comparison(uncomparable=tuple(uncomparable), failed=failed)
            uncomparable.append((key, f"its output on {run_name} is a {run.unreadable[key]}, which holds no tensor"
                                      if key in run.unreadable else f"it did not run on {run_name}"))
            continue
        name = module_name(key)
        full, parts = reference.outputs[key], [r.outputs[key] for r in runs]
        if not sharded:
            other = next((p for p in parts if p.shape != full.shape or not _close(p, full, atol, rtol)), None)
            if other is None:
                continue
            diff = float("inf") if other.shape != full.shape else max_abs_diff(other, full)
            return Comparison(key, diff, tuple(uncomparable))
        layouts = [r.layouts.get(name) for r in runs] if name in reference.layouts else None
        rebuilt, why = reassemble(full, parts, layouts, reference.layouts.get(name), dim=-1)
        if rebuilt is None:
            uncomparable.append((key, why))
            continue
        if all(p.shape == full.shape for p in parts):  # replicated: every rank must hold the reference output
            rebuilt = next((p for p in parts if not _close(p, full, atol, rtol)), None)
        elif _close(rebuilt, full, atol, rtol):
            rebuilt = None
        if rebuilt is not None:
            return Comparison(key, max_abs_diff(rebuilt, full), tuple(uncomparable))
    return Comparison(uncomparable=tuple(uncomparable), failed=failed)


def weights_problem(key: str, one: Capture, ranks: list[Capture]) -> str | None:
    """Why the module's weights on the ranks do not reassemble to its TP=1 weights, or None when they do."""
    name = module_name(key)
    layout1 = one.layouts.get(name)
    layouts = [r.layouts.get(name) for r in ranks] if layout1 is not None else None
    for param, full in one.params.get(name, {}).items():
        missing = next((i for i, r in enumerate(ranks) if param not in r.params.get(name, {})), None)
        if missing is not None:
            return f"rank {missing} has no {param}"
        parts = [r.params[name][param] for r in ranks]
        row_parallel = layout1 is not None and not layout1["column"] and param == "weight"
        if row_parallel and layouts is not None and all(layouts):  # rank r holds input columns from input_start
            for rank, (part, layout) in enumerate(zip(parts, layouts, strict=True)):
                start, width = layout["input_start"] or 0, part.shape[1]  # type: ignore[index]
                if not _close(part, full[:, start:start + width]):
                    held = next((f"{s}:{s + width}" for s in range(0, full.shape[1] - width + 1, width)
                                 if _close(part, full[:, s:s + width])), None)
                    what = f"input columns {held} of" if held else "no column block of"
                    return (f"rank {rank}'s {param} holds {what} the TP=1 {param}, not its own "
                            f"{start}:{start + width}")
            continue
        rebuilt, _ = reassemble(full, parts, layouts, layout1, dim=0)
        if not _close(rebuilt, full):
            return f"the ranks' {param} shards (shapes {[tuple(p.shape) for p in parts]}) do not reassemble to " \
                   f"the TP=1 {param} {tuple(full.shape)}"
    return None


def failed_forward(key: str, one: Capture, ranks: list[Capture], tp: int) -> str:
    """Where and why the TP=``tp`` forward failed in module call ``key``, and the parallel style its input
    calls for when a linear layer's input arrived sharded or whole against its declaration."""
    rank = next(r for r in ranks if r.failed_in == key)
    name = module_name(key)
    cls = rank.classes.get(name, "?")
    got, want = rank.input_shapes.get(key), one.input_shapes.get(key)
    layout = rank.layouts.get(name)
    where = f"{name} ({cls}) fails at tensor_parallel_size={tp}: {rank.error}"
    if layout is None or got is None or want is None:
        return f"{where} (it runs at tensor_parallel_size=1)."
    if layout["column"] and got[-1] * tp == want[-1]:
        return (f"{name} is declared column-parallel ({cls}), but its input arrives sharded (width {got[-1]} of "
                f"{want[-1]} on each rank, the output of a column-parallel layer before it): a layer whose input "
                f"is sharded is row-parallel. Make {name} a RowParallelLinear.")
    if not layout["column"] and layout["input_start"] is not None and got[-1] == want[-1] and cls != "ReplicatedLinear":
        return (f"{name} is declared row-parallel ({cls}), but its input arrives whole (width {got[-1]}): a layer "
                f"whose input is not sharded is column-parallel (or replicated). Make {name} a ColumnParallelLinear.")
    return f"{where} (input {got} on each rank, {want} at tensor_parallel_size=1)."


def _uncomparable_sentences(c: Comparison, one: Capture, between: str) -> str:
    """The first call that could not be compared, and how many more did, before what the walk found."""
    if not c.uncomparable:
        return ""
    key, why = c.uncomparable[0]
    more = len(c.uncomparable) - 1
    rest = f" ({more} more module call{'s' if more > 1 else ''} after it could not be compared either)" if more else ""
    return (f"The first module that could not be compared between {between} is {key} "
            f"({one.classes.get(module_name(key), '?')}): {why}{rest}. Its own output may be where they first "
            f"differ. ")


def explain_tp(one: Capture, ranks: list[Capture], tp: int, started: bool = True) -> Diagnosis:
    """The diagnosis of TP=``tp`` (``ranks``) against TP=1 (``one``), both run on the same prompt; ``started``:
    whether the engine started at TP=``tp`` (then its tokens differed), or failed to."""
    c = compare(one, ranks)
    between = f"tensor_parallel_size=1 and {tp}"
    lead = _uncomparable_sentences(c, one, between)
    first = c.uncomparable[0][0] if c.uncomparable else None
    if c.differs is not None:
        cls = one.classes.get(module_name(c.differs), "?")
        head = (f"After it, the first module whose output differs is {c.differs} ({cls})" if lead else
                f"The first module whose output differs between {between} is {c.differs} ({cls})")
        problem = weights_problem(c.differs, one, ranks)
        if c.differs == one.logits and not problem:
            return Diagnosis(lead + _logits_verdict(head, c, one, ranks), first or c.differs)
        if problem:
            name = module_name(c.differs)
            loaders = loaded_by(list(dict.fromkeys(n for r in ranks for n in r.loaders.get(name, []))))
            verdict = (f"{head}: its weights do not reassemble to the TP=1 weights ({problem}): a sharding bug in "
                       f"its weight_loader{': ' + loaders if loaders else ''}.")
        else:
            verdict = (f"{head}: its weights reassemble to the TP=1 weights, but its output does not (max abs "
                       f"difference {c.max_abs_diff:.3g}): a missing or extra collective (an all-reduce skipped, "
                       f"repeated or on the wrong tensor)")
            verdict += f", or its input already differs ({first} runs before it)." if lead else "."
        return Diagnosis(lead + verdict, first or c.differs)
    if c.failed is not None:
        return Diagnosis(lead + failed_forward(c.failed, one, ranks, tp), first or c.failed)
    error = next((r.error for r in ranks if r.error is not None), None)
    if error is not None:
        return Diagnosis(f"{lead}The forward fails at tensor_parallel_size={tp} outside every module's forward "
                         f"({error}), after every module it could compare gave the TP=1 output.", first)
    covered = ("The hooked forward of this prompt (its prefill, without the KV cache) gives the same output at "
               f"{between} in every module it could compare" if lead else
               f"No module's output differs between {between} in the hooked forward of this prompt (its prefill, "
               f"without the KV cache)")
    if not started:
        return Diagnosis(f"{lead}{covered}: the start fails outside the forward of the model's modules.", first)
    if _compared(one.logits, one, ranks, c):
        return Diagnosis(f"{lead}{covered}, its logits included: the tokens diverge in decoding with the KV cache, "
                         f"after the prefill. Hint: check the KV cache writes and reads of the layers this model "
                         f"changed.", first)
    return Diagnosis(f"{lead}{covered}, but its logits were not compared: the tokens diverge in compute_logits or "
                     f"in decoding with the KV cache. Hint: check the weight_loader and the collectives of the layers "
                     f"this model changed.", first)


def _compared(key: str | None, one: Capture, runs: list[Capture], c: Comparison) -> bool:
    """Whether the walk ``c`` compared call ``key`` in every run (it was captured, readable and not passed over)."""
    return (key is not None and key in one.outputs and all(key in r.outputs for r in runs)
            and key not in {k for k, _ in c.uncomparable})


def _logits_verdict(head: str, c: Comparison, one: Capture, ranks: list[Capture]) -> str:
    """Why the logits differ at TP=N where every call before them agrees (and the LM head's shards reassemble,
    where the capture holds its weight)."""
    shards = bool(one.params.get(one.logits or ""))
    agree = [*(["the LM head's weight shards reassemble to the TP=1 weight"] if shards else []),
             *([f"the model's output ({one.root}) agrees"] if _compared(one.root, one, ranks, c) else [])]
    unseen = "" if shards else " The LM head's weight was not found, so its shards were not compared."
    return (f"{head}: {' and '.join(agree) or 'every output compared before them agrees'}, but the logits do not "
            f"(max abs difference {c.max_abs_diff:.3g}): compute_logits computes or gathers the ranks' vocabulary "
            f"shards wrongly (each rank's logits are the hidden states times its own LM-head rows, gathered in rank "
            f"order).{unseen}")


def _outcome(run: Capture) -> str:
    return "runs" if run.error is None else f"raises {run.error} in {run.failed_in}"


def explain_seeds(first: Capture, second: Capture, seeds: tuple[int, int]) -> Diagnosis | None:
    """None when two TP=1 runs built and run under ``seeds`` agree exactly; else the first module whose output
    (or build) changes between them."""
    a, b = seeds
    if first.error != second.error or first.failed_in != second.failed_in:
        return Diagnosis(f"Its hooked forward {_outcome(first)} under seed {a} but {_outcome(second)} under seed "
                         f"{b}.", first.failed_in or second.failed_in)
    c = compare(first, [second], names=[f"the run under seed {b}"], atol=0.0, rtol=0.0, sharded=False)
    lead = _uncomparable_sentences(c, first, f"seeds {a} and {b}")
    if c.differs is None:
        if first.error is not None:
            return Diagnosis(f"{lead}Its hooked forward raises {first.error} in {first.failed_in} under both seeds, "
                             f"so no module before it changes; what follows it was not compared.", first.failed_in)
        return None
    name = module_name(c.differs)
    cls = first.classes.get(name, "?")
    if first.outputs[c.differs].shape != second.outputs[c.differs].shape:
        change = (f"its output has shape {tuple(first.outputs[c.differs].shape)} under seed {a} and "
                  f"{tuple(second.outputs[c.differs].shape)} under seed {b}")
    else:
        change = f"max abs difference {c.max_abs_diff:.3g}"
    drawn = _drawn(name, first, second)
    if drawn:
        why = (f"its {' and '.join(drawn)} differ between the two builds: they are drawn from the random number "
               f"generator when it is built, not loaded from the checkpoint")
    else:
        why = ("its weights are the same in both builds and the modules that ran before it gave the same outputs, "
               "so its own forward changes with the seed: it draws random numbers (or reads memory it never "
               "initialised). Hint: dropout left in training mode (call eval() or use p=0 at inference), "
               "torch.rand*/randn*/multinomial or sampling inside forward")
    head = "After it, the first module whose output changes" if lead else (
        f"The first module whose output changes between seeds {a} and {b}")
    return Diagnosis(f"{lead}{head} is {c.differs} ({cls}) ({change}): {why}.", c.differs)


def _drawn(name: str, first: Capture, second: Capture) -> list[str]:
    """The own parameters of module ``name`` that differ between two builds (drawn, not loaded)."""
    return [p for p, t in first.params.get(name, {}).items()
            if not _close(second.params.get(name, {}).get(p), t, atol=0.0, rtol=0.0)]


def explain_rerun(first: list[Capture], second: list[Capture], tp: int) -> Diagnosis | None:
    """None when two runs at TP=``tp`` (each a list of its ranks' Captures), built and run alike under the same
    seed, agree exactly on every rank; else a ``nondeterministic`` Diagnosis naming the first module call whose
    output (or build, or failure) changes between them, on the rank where it changes first."""
    between = f"two runs at tensor_parallel_size={tp}"
    for rank, (a, b) in enumerate(zip(first, second, strict=True)):
        if a.error != b.error or a.failed_in != b.failed_in:
            return Diagnosis(f"On rank {rank}, its hooked forward {_outcome(a)} in the first of {between} but "
                             f"{_outcome(b)} in the second.", a.failed_in or b.failed_in, nondeterministic=True)
    found = [(rank, compare(a, [b], names=[f"rank {rank} of the second run"], atol=0.0, rtol=0.0, sharded=False))
             for rank, (a, b) in enumerate(zip(first, second, strict=True))]
    changed = [(rank, c) for rank, c in found if c.differs is not None]
    if not changed:
        return None
    rank, c = min(changed, key=lambda rc: first[rc[0]].order.index(str(rc[1].differs)))
    key, a, b = str(c.differs), first[rank], second[rank]
    name = module_name(key)
    lead = _uncomparable_sentences(c, a, f"{between} (rank {rank})")
    head = "After it, the first module whose output changes" if lead else (
        f"The first module whose output changes between {between} of the same prompt under the same seed")
    drawn = _drawn(name, a, b)
    if drawn:
        why = (f"its {' and '.join(drawn)} differ between the two builds: they are drawn from a random number "
               f"generator no seed reaches, not loaded from the checkpoint")
    else:
        why = ("its weights are the same in both runs and the modules that ran before it gave the same outputs, so "
               "its own forward changes from run to run: it draws random numbers from a generator no seed reaches "
               "(seeded from the clock, os.urandom or a fresh torch.Generator), or reads memory it never "
               "initialised")
    return Diagnosis(f"{lead}{head} is {key} ({a.classes.get(name, '?')}) on rank {rank} (max abs difference "
                     f"{c.max_abs_diff:.3g}): {why}.", c.differs, nondeterministic=True)
