"""When TP=N disagrees with TP=1: name the first module whose output differs, and say why.

The model is built and run twice on the same tokens, on one rank and on N real gloo ranks, with a
forward hook on every module. Each rank's outputs and weights are put back together with the layer's own
sharding (``output_shard`` rows for column-parallel layers, ``input_start`` columns for row-parallel
ones), then compared with TP=1's in the order the modules finished (innermost first). The first module
that differs is either a sharding bug (its weights do not reassemble to TP=1's) or a collective bug (they
do, its output does not). A forward that fails at TP=N names the module it failed in and, for a linear
layer, whether its input arrived sharded or whole, which says which parallel style it needs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ATOL, RTOL = 1e-4, 1e-3


@dataclass
class Capture:
    """One rank's run: per module (in the order they finished) its output, input shape and sharding."""

    order: list[str] = field(default_factory=list)
    outputs: dict[str, Any] = field(default_factory=dict)
    input_shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)
    classes: dict[str, str] = field(default_factory=dict)
    layouts: dict[str, dict[str, Any]] = field(default_factory=dict)  # linear layers' sharding
    params: dict[str, dict[str, Any]] = field(default_factory=dict)  # module -> its own weight/bias
    failed_in: str | None = None  # the innermost module running when the forward raised
    error: str | None = None


def _first_tensor(value: Any) -> Any:
    import torch

    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, (tuple, list)):
        return next((v for v in value if isinstance(v, torch.Tensor)), None)
    return None


def _layout(module: Any) -> dict[str, Any] | None:
    from engine_ref.model_executor.layers.linear import LinearBase

    if not isinstance(module, LinearBase):
        return None
    return {"column": module.output_is_sharded, "input_start": module.input_start,
            "shards": {sid: (module.output_shard(sid) if module.output_is_sharded else (0, rows, 0))
                       for sid, rows in module.output_shards.items()}}


def capture(rank: int, world_size: int, spec: str, ckpt: str, prompt: list[int]) -> Capture:
    """Runs on each rank (a multirank child): build and load the model of target ``spec``, run ``prompt`` once
    with hooks."""
    import torch

    from engine_ref.engine.arg_utils import EngineArgs
    from engine_ref.engine.scheduler import ScheduledSequence
    from engine_ref.model_executor.model_loader.loaders import get_model_loader
    from engine_ref.worker.model_runner import ModelRunner
    from pytest_enginecheck.targets import engine_ref_registry

    engine_ref_registry(spec)
    # One thread: the check process that forked this rank has run its own engine, and an OpenMP pool
    # inherited through fork deadlocks at the first parallel region.
    torch.set_num_threads(1)
    config = EngineArgs(model=ckpt, tensor_parallel_size=world_size, device_memory="1GiB", max_model_len=128,
                        distributed_executor_backend="uni" if world_size == 1 else "mp",
                        ).create_engine_config(inspect_in_subprocess=False)
    model = get_model_loader(config.load_config).load_model(config, torch.device("cpu"))
    result = Capture()
    running: list[str] = []  # the keys of the modules running now, innermost last
    calls: dict[str, int] = {}
    for name, module in model.named_modules():
        if not name:
            continue
        result.classes[name] = type(module).__name__
        layout = _layout(module)
        if layout is not None:
            result.layouts[name] = layout
        own = {p: t.detach().clone() for p, t in module.named_parameters(recurse=False) if p in ("weight", "bias")}
        if own:
            result.params[name] = own

        def pre(mod: Any, args: tuple, name: str = name) -> None:
            calls[name] = calls.get(name, 0) + 1  # a module shared by the layers (rotary) runs once per layer
            key = name if calls[name] == 1 else f"{name} (call {calls[name]})"
            running.append(key)
            first = _first_tensor(args)
            if first is not None:
                result.input_shapes[key] = tuple(first.shape)

        def post(mod: Any, args: tuple, output: Any, name: str = name) -> None:
            key = running.pop()
            first = _first_tensor(output)
            if first is not None:
                result.order.append(key)
                result.outputs[key] = first.detach().clone()

        module.register_forward_pre_hook(pre)
        module.register_forward_hook(post)
    runner = ModelRunner(model, config, torch.device("cpu"))
    try:
        with torch.inference_mode():
            runner._run([ScheduledSequence(0, list(prompt), 0, [])], with_cache=False)
    except Exception as e:  # noqa: BLE001 - what failed, and where, is the diagnosis
        result.failed_in = running[-1] if running else None
        result.error = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    return result


def _assemble(full_like: Any, parts: list[Any], layouts: list[dict[str, Any]] | None, full_layout: Any,
              dim: int) -> Any:
    """The TP=1 tensor rebuilt from the ranks' parts, or None when their shapes cannot make it."""
    import torch

    if all(p.shape == full_like.shape for p in parts):
        return parts[0]
    dim = dim % full_like.dim()
    if layouts is not None and full_layout is not None and layouts[0]["column"]:  # rows by the layer's shards
        out = torch.full_like(full_like, float("nan"))
        for part, layout in zip(parts, layouts, strict=True):
            for sid, (offset, size, start) in layout["shards"].items():
                base = full_layout["shards"][sid][0]
                out.narrow(dim, base + start, size).copy_(part.narrow(dim, offset, size))
        return out
    differing = [d for d in range(full_like.dim()) if parts[0].shape[d] != full_like.shape[d]]
    if len(differing) == 1 and sum(p.shape[differing[0]] for p in parts) == full_like.shape[differing[0]]:
        return torch.cat(parts, dim=differing[0])  # sharded along its one short dimension, in rank order
    return None


def _module(key: str) -> str:
    """The module's name of a call's key (``name`` or ``name (call 2)``)."""
    return key.split(" (call ")[0]


def _close(a: Any, b: Any) -> bool:
    import torch

    return a is not None and a.shape == b.shape and torch.allclose(a.float(), b.float(), atol=ATOL, rtol=RTOL)


def _weights_problem(key: str, one: Capture, ranks: list[Capture]) -> str | None:
    """Why the module's weights on the ranks do not reassemble to its TP=1 weights, or None when they do."""
    name = _module(key)
    layout1 = one.layouts.get(name)
    layouts = [r.layouts[name] for r in ranks] if layout1 is not None else None
    for param, full in one.params.get(name, {}).items():
        parts = [r.params[name][param] for r in ranks]
        row_parallel = layout1 is not None and not layout1["column"] and param == "weight"
        if row_parallel:  # each rank holds input columns [input_start, input_start + width)
            for rank, (part, layout) in enumerate(zip(parts, layouts or [], strict=True)):
                start, width = layout["input_start"], part.shape[1]
                if not _close(part, full[:, start:start + width]):
                    held = next((f"{s}:{s + width}" for s in range(0, full.shape[1] - width + 1, width)
                                 if _close(part, full[:, s:s + width])), None)
                    what = f"input columns {held} of" if held else "no column block of"
                    return (f"rank {rank}'s {param} holds {what} the TP=1 {param}, not its own "
                            f"{start}:{start + width}")
            continue
        rebuilt = _assemble(full, parts, layouts, layout1, dim=0)
        if not _close(rebuilt, full):
            return f"the ranks' {param} shards (shapes {[tuple(p.shape) for p in parts]}) do not reassemble to " \
                   f"the TP=1 {param} {tuple(full.shape)}"
    return None


def _failed_forward(key: str, one: Capture, ranks: list[Capture], tp: int) -> str:
    rank = next(r for r in ranks if r.failed_in == key)
    name = _module(key)
    cls = rank.classes[name]
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


def diagnose(spec: str, ckpt: Path, tp: int, prompt: list[int], timeout: float = 120.0) -> str | None:
    """The sentence naming the first module that differs at TP=``tp`` and why, or None if none is found."""
    from pytest_enginecheck.multirank import run_multirank

    (one,) = run_multirank(capture, 1, spec, str(ckpt), prompt, timeout=timeout)
    if one.error is not None:
        return None  # TP=1 itself fails: the load[tp=1] item reports it
    ranks = run_multirank(capture, tp, spec, str(ckpt), prompt, timeout=timeout)
    failed = next((r.failed_in for r in ranks if r.failed_in is not None), None)
    for key in one.order:
        if failed == key or key not in ranks[0].outputs:
            break
        name = _module(key)
        layouts = [r.layouts[name] for r in ranks] if name in one.layouts else None
        full = one.outputs[key]
        parts = [r.outputs[key] for r in ranks]
        rebuilt = _assemble(full, parts, layouts, one.layouts.get(name), dim=-1)
        replicated = all(p.shape == full.shape for p in parts)
        if rebuilt is None or (all(_close(p, full) for p in parts) if replicated else _close(rebuilt, full)):
            continue
        if replicated:
            rebuilt = next(p for p in parts if not _close(p, full))
        cls = one.classes[name]
        problem = _weights_problem(key, one, ranks)
        head = f"The first module whose output differs between tensor_parallel_size=1 and {tp} is {key} ({cls})"
        if problem:
            return f"{head}: its weights do not reassemble to the TP=1 weights ({problem}): a sharding bug in " \
                   f"its weight_loader."
        diff = (rebuilt.float() - full.float()).abs().max().item()
        return (f"{head}: its weights reassemble to the TP=1 weights, but its output does not (max abs difference "
                f"{diff:.3g}): a missing or extra collective (an all-reduce skipped, repeated or on the wrong "
                f"tensor).")
    if failed is not None:
        return _failed_forward(failed, one, ranks, tp)
    return None
