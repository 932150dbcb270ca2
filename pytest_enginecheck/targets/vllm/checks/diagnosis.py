"""When vLLM at TP=N generates other tokens than at TP=1: name the first module whose output differs.

The mismatching prompt is run once more, prefill only (``max_tokens=1``), at TP=1 and at TP=N, with a
forward hook on every module of vLLM's model in each worker (installed and collected through
``LLM.collective_rpc``). Each module's rank outputs are put back together by the layer's own partitioning
(a column-parallel layer's ``output_partition_sizes``, QKV's replicated KV heads taken once, a sum for a
layer that does not reduce its results, whole for a reduced or gathered one) and compared with TP=1's in
the order the modules finished. vLLM's CPU backend packs linear weights after loading, so weights are not
compared; instead the hook of a row-parallel (or gathering) layer keeps the rank's own product before its
collective (the layer's ``quant_method.apply`` on its local input), which tells a wrong weight shard from a
wrong collective. A module that cannot be put back together or compared is reported, never skipped. Where a module's
weight shards are wrong, the weight loaders of its parameters (read in the workers, ``module_loaders``) are named
with their file and line.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pytest_enginecheck.targets.vllm.engine.drive import EngineStartError, EngineWork, HookedPrefill
from pytest_enginecheck.targets.vllm.engine.run import run_engine
from pytest_enginecheck.targets.vllm.probe import LINEAR_MODULE, VllmUnavailable, sharding_api, worker_model
from pytest_enginecheck.tp_compare import (
    CallKeys,
    close,
    first_tensor,
    join_split,
    loaded_by,
    loader_name,
    max_abs_diff,
    module_name,
    weight_loaders,
)

_STATE = "_enginecheck_capture"  # the worker attribute holding the hooks and what they captured


@dataclass
class RankCapture:
    """One rank's forward: per call of a module (in the order they finished) its output and first input."""

    rank: int
    order: list[str] = field(default_factory=list)
    outputs: dict[str, Any] = field(default_factory=dict)
    inputs: dict[str, Any] = field(default_factory=dict)
    local: dict[str, Any] = field(default_factory=dict)  # a linear layer's own product before its collective
    classes: dict[str, str] = field(default_factory=dict)
    layouts: dict[str, dict[str, Any]] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)  # a hook that could not record the call, and why
    loaders: dict[str, list[str]] = field(default_factory=dict)  # module -> "qualname (file:line)" of its loaders


def layout(module: Any) -> dict[str, Any]:
    """How the module's output is split over the ranks, from vLLM's own layer attributes.

    ``style``: "column" (this rank's ``partitions`` of the output's last dim, ``replicas`` ranks holding each),
    "whole" (every rank holds the whole output), "partial" (a sum over the ranks) or "shape" (decided by the
    shapes: whole when equal to TP=1's, else concatenated along the one shorter dimension).
    """
    api = sharding_api()
    tp = int(getattr(module, "tp_size", 1) or 1)
    if isinstance(module, api.column):
        partitions = list(module.output_partition_sizes)
        replicas = [1] * len(partitions)
        if isinstance(module, api.qkv) and len(partitions) == 3:
            replicas[1] = replicas[2] = int(module.num_kv_head_replicas)
        column = {"style": "column", "partitions": partitions, "replicas": replicas}
        if getattr(module, "gather_output", False) and tp > 1:  # ``local``: how its own products reassemble
            return {"style": "whole", "how": "all-gathered", "local": column}
        return column
    if isinstance(module, api.row):
        if module.reduce_results and tp > 1:
            return {"style": "whole", "how": "all-reduced", "local": {"style": "partial"}}
        return {"style": "partial" if tp > 1 else "whole", "how": "not reduced"}
    if isinstance(module, api.vocab):
        return {"style": "whole", "how": "all-reduced"}
    if getattr(module, "reduce_results", True) is False and tp > 1:  # e.g. a FusedMoE reduced by its caller
        return {"style": "partial"}
    return {"style": "shape"}


def _local_product(module: Any, x: Any) -> Any:
    """The rank's own product of a row-parallel or gathering column-parallel layer, before its collective."""
    api = sharding_api()
    if isinstance(module, api.row):
        if not module.input_is_parallel:
            x = x.chunk(module.tp_size, dim=-1)[module.tp_rank].contiguous()
        bias = None if (module.tp_rank > 0 or module.skip_bias_add) else module.bias
        return module.quant_method.apply(module, x, bias)
    bias = None if module.skip_bias_add else module.bias
    return module.quant_method.apply(module, x, bias)


def module_loaders(module: Any) -> list[str]:
    """The weight loaders of the module's parameters, as ``qualname (file:line)`` (``tp_compare.weight_loaders``).

    vLLM's CPU backend replaces a linear layer's weight after loading by a packed one that carries no loader; for it,
    the loader vLLM's parallel linear layers give their weight when they create it: ``weight_loader_v2`` where the
    layer's quant method is one of vLLM's ``WEIGHT_LOADER_V2_SUPPORTED``, else ``weight_loader``.
    """
    import importlib

    found = weight_loaders(module)
    api = sharding_api()
    weight = dict(module.named_parameters(recurse=False)).get("weight")
    packed = weight is not None and getattr(weight, "weight_loader", None) is None
    if not (packed and isinstance(module, (api.column, api.row))):
        return found
    supported = getattr(importlib.import_module(LINEAR_MODULE), "WEIGHT_LOADER_V2_SUPPORTED", None)
    if supported is None:
        return found
    v2 = type(getattr(module, "quant_method", None)).__name__ in supported
    name = loader_name(getattr(module, "weight_loader_v2" if v2 else "weight_loader", None))
    return [name, *(n for n in found if n != name)] if name else found


def install_hooks(worker: Any) -> int:
    """Run on each vLLM worker (``collective_rpc``): hook every module of its model; the number hooked."""
    model = worker_model(worker)
    capture = RankCapture(rank=int(getattr(worker, "rank", 0)))
    keys = CallKeys()
    handles = []
    for name, module in model.named_modules():
        if not name:
            continue
        capture.classes[name] = type(module).__name__
        try:
            capture.layouts[name] = layout(module)
        except (AttributeError, TypeError) as e:  # a vLLM whose layer lacks an attribute the layout reads
            why = f"its sharding cannot be read ({type(e).__name__}: {e})"
            capture.layouts[name] = {"style": "unknown", "why": why}
        keeps_local = "local" in capture.layouts[name]
        try:
            capture.loaders[name] = module_loaders(module)
        except Exception:  # noqa: BLE001 - a loader it cannot read is not named; the diagnosis goes on
            capture.loaders[name] = []

        def pre(mod: Any, args: tuple, name: str = name) -> None:
            key = keys.enter(name)
            first = first_tensor(args)
            if first is not None:
                capture.inputs[key] = first.detach().clone()

        def post(mod: Any, args: tuple, output: Any, keeps_local: bool = keeps_local) -> None:
            key = keys.leave()
            capture.order.append(key)
            first = first_tensor(output)
            if first is None:
                capture.errors[key] = f"its output is {type(output).__name__}, not a tensor"
                return
            capture.outputs[key] = first.detach().clone()
            if keeps_local and key in capture.inputs:
                try:
                    capture.local[key] = _local_product(mod, capture.inputs[key]).detach().clone()
                except Exception as e:  # noqa: BLE001 - reported with the module, if it is the one that differs
                    capture.errors[key] = f"its own product could not be recomputed ({type(e).__name__}: {e})"

        handles += [module.register_forward_pre_hook(pre), module.register_forward_hook(post)]
    setattr(worker, _STATE, (capture, handles))
    return len(capture.classes)


def collect(worker: Any) -> RankCapture:
    """Run on each vLLM worker after the forward: remove the hooks, return what they captured."""
    capture, handles = getattr(worker, _STATE)
    for handle in handles:
        handle.remove()
    delattr(worker, _STATE)
    return capture


def reassemble(full: Any, parts: list[Any], layout: dict[str, Any]) -> tuple[Any, str]:
    """The TP=1-shaped tensor rebuilt from the ranks' ``parts`` and how; (None, why not) when it cannot be."""
    import torch

    style = layout["style"]
    shapes = [tuple(p.shape) for p in parts]
    if style == "unknown":
        return None, layout["why"]
    if style == "whole" or (style == "shape" and all(s == tuple(full.shape) for s in shapes)):
        if any(s != tuple(full.shape) for s in shapes):
            return None, f"its output is whole on every rank, but the ranks' shapes {shapes} are not " \
                         f"{tuple(full.shape)}"
        differing = [r for r, p in enumerate(parts) if not close(p, full)]
        return parts[differing[0] if differing else 0], f"{layout.get('how', 'replicated')}, whole on every rank"
    if style == "partial":
        if any(s != tuple(full.shape) for s in shapes):
            return None, f"its ranks' partial sums have shapes {shapes}, not {tuple(full.shape)}"
        return torch.stack([p.float() for p in parts]).sum(0), "the sum of the ranks' partial outputs"
    if style == "column":
        if any(p.shape[-1] != sum(layout["partitions"]) for p in parts):
            return None, (f"its ranks' outputs have widths {[p.shape[-1] for p in parts]}, not the "
                          f"{sum(layout['partitions'])} of its output partitions {layout['partitions']}")
        blocks = []
        for i, (size, replicas) in enumerate(zip(layout["partitions"], layout["replicas"], strict=True)):
            start = sum(layout["partitions"][:i])
            blocks += [p.narrow(-1, start, size) for p in parts[::replicas]]  # one rank of each replica group
        rebuilt = torch.cat(blocks, dim=-1)
        if rebuilt.shape != full.shape:
            return None, f"its output partitions {layout['partitions']} on {len(parts)} ranks give " \
                         f"{tuple(rebuilt.shape)}, not {tuple(full.shape)}"
        return rebuilt, f"column-parallel, its output partitions {layout['partitions']} concatenated over the ranks"
    joined = join_split(full, parts)
    if joined is not None:
        return joined[0], f"sharded along dim {joined[1]}, in rank order"
    return None, f"its ranks' output shapes {shapes} do not reassemble to the TP=1 shape {tuple(full.shape)}"


def _loaders(name: str, ranks: list[RankCapture]) -> str:
    """``: its parameters were loaded by ...`` (the loaders the ranks read for module ``name``), or nothing."""
    named = loaded_by(list(dict.fromkeys(n for r in ranks for n in r.loaders.get(name, []))))
    return f": {named}" if named else ""


def _own_products(key: str, one: RankCapture, ranks: list[RankCapture]) -> str:
    """Whether the ranks' own products (kept before the collective) put back together give TP=1's output."""
    name = module_name(key)
    errors = [r.errors[key] for r in ranks if key in r.errors]
    if errors or any(key not in r.local for r in ranks):
        return f"its ranks' own products could not be recomputed: {errors[0] if errors else 'none kept'}"
    local_layout = ranks[0].layouts[name].get("local", {"style": "partial"})
    rebuilt, _ = reassemble(one.outputs[key], [r.local[key] for r in ranks], local_layout)
    if rebuilt is None:
        return "its ranks' own products cannot be put back together to compare"
    if not close(rebuilt, one.outputs[key]):
        return (f"its ranks' own products (before the collective) do not make the TP=1 output either (they differ "
                f"by {max_abs_diff(rebuilt, one.outputs[key]):.3g}): {name}'s weight shards are wrong (a sharding bug "
                f"in its weight_loader; a row-parallel weight needs its rank's input columns){_loaders(name, ranks)}")
    return ("its ranks' own products make the TP=1 output, its output after the collective does not: a missing or "
            "extra collective (an all-reduce skipped, repeated or on the wrong tensor)")


def _why_it_differs(key: str, one: RankCapture, ranks: list[RankCapture]) -> str:
    """What the first differing module's input and its ranks' own products say."""
    name = module_name(key)
    parts = [r.inputs.get(key) for r in ranks]
    if key not in one.inputs or any(p is None for p in parts):
        said = "its input was not captured"
    else:
        rebuilt, _ = reassemble(one.inputs[key], parts, {"style": "shape"})
        if rebuilt is None:
            said = "its input cannot be put back together to compare"
        elif not close(rebuilt, one.inputs[key]):
            return (f"; its input already differs (by {max_abs_diff(rebuilt, one.inputs[key]):.3g}), so the "
                    f"difference arises in code between the modules, outside any of them (hint, not a finding)")
        else:
            said = "its input agrees"
    style = ranks[0].layouts[name]["style"]
    if "local" in ranks[0].layouts[name]:
        return f", while {said}; {_own_products(key, one, ranks)}"
    if style == "column" and said == "its input agrees":
        return (f", while {said}: each rank's output is its own weight shard's product, with no collective, so "
                f"{name}'s weight shards do not make the TP=1 weight (a sharding bug in its weight_loader)"
                f"{_loaders(name, ranks)}")
    return f"; {said}"


def compare(one: RankCapture, ranks: list[RankCapture], tp: int) -> str:
    """The sentence naming the first module whose output differs at TP=``tp`` and how (pure: captured tensors)."""
    uncompared: list[str] = []
    compared = 0
    for key in one.order:
        name = module_name(key)
        if key not in one.outputs:
            uncompared.append(f"{key} ({one.errors.get(key, 'no output')} at tensor_parallel_size=1)")
            continue
        missing = [r.rank for r in ranks if key not in r.outputs]
        if missing:
            why = next((r.errors[key] for r in ranks if key in r.errors), "it did not run")
            uncompared.append(f"{key} (rank {missing[0]}: {why})")
            continue
        full = one.outputs[key]
        rebuilt, how = reassemble(full, [r.outputs[key] for r in ranks], ranks[0].layouts[name])
        if rebuilt is None:
            uncompared.append(f"{key} ({how})")
            continue
        compared += 1
        if close(rebuilt, full):
            continue
        cls = one.classes[name]
        found = (f"The first module whose output differs between tensor_parallel_size=1 and {tp} is {key} ({cls}): "
                 f"its output differs by {max_abs_diff(rebuilt, full):.3g} (max abs; {how})"
                 f"{_why_it_differs(key, one, ranks)}.")
        if uncompared:
            found += (f" Before it, {len(uncompared)} module(s) could not be compared, so the difference may begin "
                      f"there: {'; '.join(uncompared)}.")
        return found
    tail = f"; {len(uncompared)} could not be compared: {'; '.join(uncompared)}" if uncompared else ""
    return (f"No module's output differs between tensor_parallel_size=1 and {tp} in one forward of the prompt "
            f"({compared} compared{tail}). Hint (not a finding): the difference then arises after the forward "
            f"(the logits' gather or the sampler) or only in the decode steps.")


def diagnose(ckpt: str, tp: int, prompt: list[int], mode: str = "warm", timeout: float = 120.0) -> str:
    """Run ``prompt`` at TP=1 and TP=``tp`` with hooks and say which module differs first (or why it cannot)."""
    work = EngineWork(hooked_prefill=HookedPrefill(prompt, install_hooks, collect))
    try:
        sharding_api()
        (one,) = run_engine(ckpt, 1, mode, timeout=timeout, work=work).captures
        ranks = run_engine(ckpt, tp, mode, timeout=timeout, work=work).captures
    except VllmUnavailable as e:
        return f"No diagnosis: {e}."
    except EngineStartError as e:
        return f"The diagnosis failed: {e.failure.exception} (phase {e.failure.phase}, rank {e.failure.rank})."
    if len(ranks) != tp:
        return f"The diagnosis failed: {len(ranks)} of {tp} ranks returned their capture."
    try:
        return compare(one, sorted(ranks, key=lambda r: r.rank), tp)
    except Exception as e:  # noqa: BLE001 - a diagnosis that fails says so, with its error
        return f"The diagnosis failed: {type(e).__name__}: {e}."
