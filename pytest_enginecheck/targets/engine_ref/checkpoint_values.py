"""load[tp=1]'s checkpoint oracle: the model the engine loaded holds what its checkpoint holds.

The engine's loader proves coverage by name: every parameter loaded, every checkpoint tensor consumed or declared
unused (the model's ``weights_mapper.skip``). This oracle compares values, in the TP=1 model ``load_check.tp1_model``
built and loaded as a worker does:
- every parameter equals the checkpoint tensors it is loaded from, cast to its dtype. At TP=1 a parameter is its one
  tensor, or the tensors of its ``checkpoint_shapes`` stacked along its ``output_dim`` (q, k, v into qkv_proj), or,
  for ``(expert, which)`` shard ids, each expert's tensors stacked and the experts stacked before them (w13, w2).
  One whose checkpoint name the weights mapper skips is derived by the model (declared derived); one whose layout
  none of these rebuilds is not compared, and the detail says which (never a false alarm);
- every persistent buffer equals its checkpoint tensor, or is declared derived (its checkpoint name skipped);
- lm_head shares the embedding's weight exactly when config.json's ``tie_word_embeddings`` is true; untied, it is a
  parameter of its own, compared with the checkpoint's lm_head.weight above.
Names cannot see a value overwritten after loading, a tensor loaded into another parameter, or a head tied against
the config; this can. Exact: a weight_loader copies and casts, nothing computes. A quantized checkpoint is not
compared (process_weights_after_loading converts its weights on purpose).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from pytest_enginecheck.checks import CheckContext, CheckFailure

if TYPE_CHECKING:
    import torch
    from torch import nn

ORACLE = "checkpoint"  # the detail's checkpoint_oracle: what the loaded values were compared with
SHOWN = 4  # findings the message names; the detail lists them all
HINT = ("Hint: a weight_loader copies the checkpoint's values; look for what writes the parameter afterwards "
        "(the end of load_weights, process_weights_after_loading) or hands it another tensor.")


@dataclass(frozen=True)
class Part:
    """Where one checkpoint tensor lies in a reassembled value."""

    name: str
    index: tuple[Any, ...]


def verify_checkpoint_values(ctx: CheckContext, ckpt: Path, model: nn.Module) -> dict[str, Any]:
    """Fail (kind ``checkpoint_mismatch``) when ``model`` (TP=1, loaded from ``ckpt``) holds a parameter or persistent
    buffer other than what the checkpoint holds for it, or ties lm_head otherwise than config.json says; return the
    detail: the oracle, how many tensors were compared, how lm_head is tied and what was not compared, and why."""
    from safetensors.torch import load_file

    config = json.loads((ckpt / "config.json").read_text())
    if "quantization_config" in config or "quantization_config" in config.get("text_config", {}):
        return {"checkpoint_oracle": ORACLE,
                "checkpoint_not_compared": {"*": "a quantized checkpoint: process_weights_after_loading converts it"}}
    tensors: dict[str, torch.Tensor] = {}
    files: dict[str, str] = {}
    for file in sorted(ckpt.glob("*.safetensors")):
        for name, tensor in load_file(str(file)).items():
            tensors[name], files[name] = tensor, file.name
    mapper = getattr(model, "weights_mapper", None)
    findings: list[tuple[str, str]] = []  # (parameter, buffer or module named, what is wrong)
    not_compared: dict[str, str] = {}
    compared = 0
    named = [("parameter", *p) for p in model.named_parameters()] + [("buffer", *b) for b in persistent_buffers(model)]
    for kind, name, tensor in named:
        if kind == "buffer" and (finding := unloaded_buffer(name, mapper, tensors)) is not None:
            findings.append((name, finding))
            continue
        value = reassemble(tensor, name, mapper, tensors)
        if isinstance(value, str):
            not_compared[name] = value
            continue
        compared += 1
        finding = compare(f"{kind} {name}", tensor, *value, files)
        if finding is not None:
            findings.append((name, finding))
    tying, wrong_ties = check_tying(model, config, mapper, tensors)
    findings += wrong_ties
    detail: dict[str, Any] = {"checkpoint_oracle": ORACLE, "checkpoint_compared": compared,
                              "checkpoint_tying": tying, "checkpoint_not_compared": not_compared}
    if not findings:
        return detail
    shown = "; ".join(text for _, text in findings[:SHOWN])
    more = f"; and {len(findings) - SHOWN} more (the detail's checkpoint_findings)" if len(findings) > SHOWN else ""
    raise CheckFailure(
        f"{ctx.architecture} at tensor_parallel_size=1 does not hold what its checkpoint holds "
        f"({len(findings)} finding(s)): {shown}{more}. {HINT}",
        {**detail, "kind": "checkpoint_mismatch", "parameter": findings[0][0],
         "checkpoint_findings": {name: text for name, text in findings}})


def persistent_buffers(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """The model's persistent buffers (those its state_dict holds), each once."""
    from torch import nn

    seen: set[int] = set()
    buffers = []
    for name, tensor in model.state_dict(keep_vars=True).items():
        if not isinstance(tensor, nn.Parameter) and id(tensor) not in seen:
            seen.add(id(tensor))
            buffers.append((name, tensor))
    return buffers


def unloaded_buffer(name: str, mapper: Any, tensors: dict[str, torch.Tensor]) -> str | None:
    """The finding for a persistent buffer that the checkpoint holds no tensor for and that is not declared
    derived (its checkpoint name in the weights_mapper's skip); None for any other."""
    checkpoint_name = mapper.to_checkpoint(name, None) if mapper is not None else name
    if checkpoint_name in tensors or any(part in checkpoint_name for part in (mapper.skip if mapper else ())):
        return None
    return (f"buffer {name} is persistent (the state_dict holds it) but neither in the checkpoint (no "
            f"{checkpoint_name!r}) nor declared derived: register it with persistent=False if the model computes "
            f"it, or add it to the weights_mapper's skip")


def reassemble(param: torch.Tensor, name: str, mapper: Any, tensors: dict[str, torch.Tensor]
               ) -> tuple[torch.Tensor, list[Part]] | str:
    """The TP=1 value of ``param`` (named ``name``) put together from the checkpoint's ``tensors``, with where each
    tensor lies in it; or why it cannot be (declared derived, a tensor the checkpoint lacks, a layout unknown here)."""
    import torch

    from engine_ref.model_executor.model_loader.weight_utils import checkpoint_shapes, param_dim

    param = cast("nn.Parameter", param)  # a buffer has none of a parameter's loader attributes: one tensor, own shape
    shapes = checkpoint_shapes(param)
    try:
        names = {sid: mapper.to_checkpoint(name, sid) if mapper is not None else name for sid in shapes}
    except KeyError as e:
        return f"no checkpoint name: {e.args[0]}"
    skip = tuple(mapper.skip) if mapper is not None else ()
    if any(part in n for n in names.values() for part in skip):
        return "declared derived: its checkpoint name is in the weights_mapper's skip"
    absent = [n for n in names.values() if n not in tensors]
    if absent:
        return f"the checkpoint holds no {absent[0]!r}"
    named = [(n, tensors[n]) for n in names.values()]
    try:
        if list(shapes) == [None]:
            value, parts = named[0][1], [Part(named[0][0], ())]
        elif all(isinstance(sid, tuple) and len(sid) == 2 for sid in shapes):  # (expert, which): experts stacked
            experts = list(dict.fromkeys(sid[0] for sid in shapes))
            stacked = [_concat([(names[sid], tensors[names[sid]]) for sid in shapes if sid[0] == e], 0)
                       for e in experts]
            value = torch.stack([v for v, _ in stacked])
            parts = [Part(p.name, (i, *p.index)) for i, (_, ps) in enumerate(stacked) for p in ps]
        elif (dim := param_dim(param, "output_dim")) is not None:
            value, parts = _concat(named, dim)
        else:
            return f"{len(shapes)} checkpoint tensors and no output_dim to stack them along"
    except (RuntimeError, IndexError) as e:
        return f"its checkpoint tensors do not stack ({(str(e).splitlines() or [''])[0]})"
    if tuple(value.shape) != tuple(param.shape):
        return f"its checkpoint tensors make shape {list(value.shape)}, not the parameter's {list(param.shape)}"
    return value, parts


def _concat(named: list[tuple[str, torch.Tensor]], dim: int) -> tuple[torch.Tensor, list[Part]]:
    import torch

    parts, start = [], 0
    for name, tensor in named:
        parts.append(Part(name, (slice(None),) * dim + (slice(start, start + tensor.shape[dim]),)))
        start += tensor.shape[dim]
    return torch.cat([tensor for _, tensor in named], dim=dim), parts


def compare(what: str, actual: torch.Tensor, expected: torch.Tensor, parts: list[Part], files: dict[str, str]
            ) -> str | None:
    """None when ``actual`` (``what``: "parameter NAME" or "buffer NAME", as loaded) equals the checkpoint's
    ``expected`` cast to its dtype; else the finding, naming the checkpoint tensors whose part differs."""
    import torch

    actual, expected = actual.detach(), expected.to(actual.dtype)
    if torch.equal(actual, expected):
        return None
    differ = [p for p in parts if not torch.equal(actual[p.index], expected[p.index])] or parts
    where = ", ".join(f"{p.name!r} ({files[p.name]})" for p in differ)
    unequal = actual != expected
    difference = float((actual.float() - expected.float()).abs().max())
    return (f"{what} differs from checkpoint tensor {where} in {int(unequal.sum())} of {actual.numel()} "
            f"elements (max abs difference {difference:.3g})")


def check_tying(model: nn.Module, config: dict[str, Any], mapper: Any, tensors: dict[str, torch.Tensor]
                ) -> tuple[dict[str, str], list[tuple[str, str]]]:
    """How each ``lm_head`` is tied (or why that was not compared), and the findings where config.json's
    ``tie_word_embeddings`` says otherwise: tied, lm_head must be the embedding's weight; untied, a weight of its own
    that the checkpoint holds."""
    modules = dict(model.named_modules(remove_duplicate=False))
    tying: dict[str, str] = {}
    findings: list[tuple[str, str]] = []
    for head in (n for n in modules if n.rsplit(".", 1)[-1] == "lm_head"):
        prefix = head.removesuffix("lm_head")
        embeds = [n for n in modules if n.startswith(prefix) and n.rsplit(".", 1)[-1] == "embed_tokens"]
        tie = tie_word_embeddings(config, nested=bool(prefix))
        head_weight = getattr(modules[head], "weight", None)
        embed_weight = getattr(modules[embeds[0]], "weight", None) if len(embeds) == 1 else None
        if tie is None or head_weight is None or embed_weight is None:
            tying[head] = ("not compared: config.json does not say tie_word_embeddings" if tie is None else
                           f"not compared: no single embed_tokens weight beside it ({embeds or 'none'})")
            continue
        shared = head_weight is embed_weight or (
            head_weight.untyped_storage().data_ptr() == embed_weight.untyped_storage().data_ptr())
        checkpoint_name = mapper.to_checkpoint(f"{head}.weight", None) if mapper is not None else f"{head}.weight"
        if tie and not shared:
            findings.append((head, f"config.json says tie_word_embeddings=true, but {head}.weight is not "
                                   f"{embeds[0]}.weight: the head is a copy of its own; make {head} the embedding "
                                   f"module when tie_word_embeddings is true"))
        elif not tie and shared:
            findings.append((head, f"config.json says tie_word_embeddings=false, but {head} shares {embeds[0]}'s "
                                   f"weight, so the logits come from the embedding, not from the checkpoint's "
                                   f"{checkpoint_name!r}; give {head} a ParallelLMHead of its own when "
                                   f"tie_word_embeddings is false"))
        elif not tie and checkpoint_name not in tensors:
            findings.append((head, f"config.json says tie_word_embeddings=false, but the checkpoint holds no "
                                   f"{checkpoint_name!r} for {head}"))
        tying[head] = f"{'tied' if tie else 'untied'}, as config.json says" if (tie == shared) else \
            f"{'untied' if tie else 'tied'}, against config.json"
    return tying, findings


def tie_word_embeddings(config: dict[str, Any], nested: bool) -> bool | None:
    """config.json's ``tie_word_embeddings`` for an lm_head (``nested``: inside a multimodal model, where its
    text_config's says first); None where it does not say."""
    for source in ((config.get("text_config"), config) if nested else (config,)):
        if isinstance(source, dict) and "tie_word_embeddings" in source:
            return bool(source["tie_word_embeddings"])
    return None
