"""The checkpoint tensors of vLLM's model, written with random values and proven to round-trip.

``checkpoint_shapes`` splits the model's parameters back into checkpoint names (a packed linear layer into its
``packed_modules_mapping`` shards, a fused MoE layer into one tensor per expert and projection by the model's expert
mapping, vLLM's ``hf_to_vllm_mapper`` undone); ``prove_round_trip`` loads them with the model's own ``load_weights``:
every parameter wholly loaded, every written tensor changing a parameter, else NoTinyCheckpoint naming them.
"""

from __future__ import annotations

import math
import re
from collections.abc import Collection, Iterator, Mapping
from pathlib import Path
from typing import Any

from pytest_enginecheck.targets.vllm.checkpoints.shrink import (
    SEED,
    NoTinyCheckpoint,
)
from pytest_enginecheck.targets.vllm.checkpoints.vllm_build import (
    FORK_TIMEOUT_S,
    FUSED_MOE,
    import_in_parent,
    vllm_model,
)

# vLLM's usual fused projections and their checkpoint shards, where the model's packed_modules_mapping names none.
DEFAULT_PACKED = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}
WEIGHT_STD = 0.02  # transformers' usual initializer_range
WEIGHTS_FILE = "model.safetensors"
EXPERT_LAYOUTS = (False, True)  # a fused MoE's checkpoint tensors: per expert, then stacked (checkpoint_shapes)


class NotRoundTripped(NoTinyCheckpoint):
    """The written checkpoint does not round-trip through ``load_weights``; ``unloaded``: the parameters it left
    not (wholly) loaded; ``unconsumed``: the tensors that changed no parameter."""

    def __init__(self, unloaded: list[str], message: str, unconsumed: list[str] | None = None) -> None:
        super().__init__(message)
        self.unloaded = unloaded
        self.unconsumed = unconsumed or []

    def __reduce__(self) -> tuple[Any, ...]:
        """Pickled with its fields (it leaves the fork that makes the checkpoint)."""
        return type(self), (self.unloaded, str(self), self.unconsumed)


def prove_round_trip(path: Path) -> None:
    """Load ``path``'s model.safetensors into vLLM's TP=1 model of its config.json (in a fork); NoTinyCheckpoint
    naming what the model's ``load_weights`` did not consume or did not load."""
    from engine_ref.isolation import run_isolated

    import_in_parent()
    run_isolated(_prove_in_fork, str(path), timeout=FORK_TIMEOUT_S, name="vllm-weights:prove")


def write_and_prove(path: str) -> None:
    """In a fork: build vLLM's model, write its checkpoint tensors, prove the round trip; a fused MoE's experts one
    tensor per expert and projection first, then stacked (EXPERT_LAYOUTS), the first layout's reason where neither
    round-trips."""
    with vllm_model(path) as build:
        model = build()
        first: NoTinyCheckpoint | None = None
        for stacked in EXPERT_LAYOUTS if has_fused_moe(model) else EXPERT_LAYOUTS[:1]:
            try:
                _write_layout(model, build.architecture, Path(path), stacked)
                return
            except NoTinyCheckpoint as e:
                first = first or e
        assert first is not None
        raise first


def _write_layout(model: Any, architecture: str, path: Path, stacked_experts: bool) -> None:
    """Write ``model``'s checkpoint tensors to ``path`` (``checkpoint_shapes``) and prove the round trip; where it
    fails, write them again as the model's loader takes them and prove it again: a packed layer it did not fill from
    the shards whole, a tensor it did not consume under the name its loader maps to the parameter
    (``_consumed_name``)."""
    try:
        shapes = checkpoint_shapes(model, stacked_experts=stacked_experts)
    except Exception as e:  # noqa: BLE001 - a layer the splitting rules do not know: the checker's limit
        raise NoTinyCheckpoint(f"the checker cannot split the parameters of vLLM's {architecture} into "
                               f"checkpoint tensors: {type(e).__name__}: {e}") from None
    _save_random(shapes, path)
    try:
        _prove(model, path)
    except NotRoundTripped as split:
        # a packed layer its loader did not fill from the shards: the hub checkpoint holds it fused (Moondream's
        # ``qkv``), so it is written whole, and the round trip is proven again
        whole = {name.rpartition(".")[0] for name in split.unloaded} & set(_packed_layers(model))
        renamed = {name: found for name in split.unconsumed if (found := _consumed_name(model, name, shapes[name]))}
        if not whole and not renamed:
            raise
        _save_random(checkpoint_shapes(model, whole, stacked_experts), path, renamed)
        _prove(model, path)


def _save_random(shapes: Mapping[str, tuple[tuple[int, ...], Any, bool]], path: Path,
                 renamed: Mapping[str, str] | None = None) -> None:
    """Write random tensors of ``shapes`` (``checkpoint_shapes``) under ``checkpoints.SEED`` to ``path``, those of
    ``renamed`` under its name for them."""
    import torch
    from safetensors.torch import save_file

    torch.manual_seed(SEED)
    names = renamed or {}
    tensors = {names.get(name, name): _random(shape, dtype, norm)
               for name, (shape, dtype, norm) in sorted(shapes.items())}
    save_file(tensors, str(path / WEIGHTS_FILE))


def _prove_in_fork(path: str) -> None:
    with vllm_model(path) as build:
        _prove(build(), Path(path))


def _random(shape: tuple[int, ...], dtype: Any, norm: bool) -> Any:
    """Random values of a checkpoint tensor: a norm's weight around 1, anything else around 0 (WEIGHT_STD)."""
    import torch

    if not dtype.is_floating_point:
        return torch.zeros(shape, dtype=dtype)
    values = torch.randn(shape, dtype=torch.float32) * WEIGHT_STD
    return (values + 1 if norm else values).to(dtype)


def unmapped_name(model: Any, name: str) -> str:
    """The checkpoint name vLLM's ``hf_to_vllm_mapper`` maps to the parameter ``name``: ``name`` itself where the
    mapper leaves it so, else the first inverse of one of its prefix/substring/suffix rules that maps back."""
    mapper = getattr(model, "hf_to_vllm_mapper", None)
    if mapper is None or getattr(mapper, "_map_name", None) is None or mapper._map_name(name) == name:
        return name
    for rules in (mapper.orig_to_new_prefix, mapper.orig_to_new_substr, mapper.orig_to_new_suffix):
        for orig, new in rules.items():
            if new and new in name:
                candidate = name.replace(new, orig, 1)
                if mapper._map_name(candidate) == name:
                    return str(candidate)
    return name


def expert_mapping(model: Any, moe: Any) -> list[tuple[str, str, int, str]]:
    """(parameter part, checkpoint part, expert, shard) of a fused MoE layer: the layer's own ``get_expert_mapping``
    (RoutedExperts knows its checkpoint names), else the model's, else vLLM's for gate_proj/up_proj/down_proj."""
    for owner in (moe, model):
        get = getattr(owner, "get_expert_mapping", None)
        if callable(get):
            mapping: list[tuple[str, str, int, str]] = list(get())
            if mapping:
                return mapping
    return list(moe.make_expert_params_mapping(model, ckpt_gate_proj_name="gate_proj", ckpt_down_proj_name="down_proj",
                                               ckpt_up_proj_name="up_proj", num_experts=moe.global_num_experts))


def _packed_layers(model: Any) -> list[str]:
    """The names of ``model``'s packed linear layers (one shard per ``packed_modules_mapping`` entry)."""
    packed = {**DEFAULT_PACKED, **(getattr(model, "packed_modules_mapping", None) or {})}
    return [name for name, module in model.named_modules()
            if len(packed.get(name.rpartition(".")[2], [])) == len(getattr(module, "output_sizes", None) or []) > 1]


def has_fused_moe(model: Any) -> bool:
    """Whether ``model`` has a fused MoE layer (FUSED_MOE)."""
    from pytest_enginecheck.targets.vllm.probe import find

    fused_moe = find(FUSED_MOE, "the tiny checkpoint splits fused experts with")
    return any(isinstance(module, fused_moe) for module in model.modules())


def checkpoint_shapes(model: Any, whole: Collection[str] = (), stacked_experts: bool = False
                      ) -> dict[str, tuple[tuple[int, ...], Any, bool]]:
    """The checkpoint tensors vLLM's TP=1 ``model`` loads: name -> (shape, dtype, whether a norm's weight); the
    packed layers named in ``whole`` as one tensor each, not split into their shards. A fused MoE's experts one
    tensor per expert and projection, or with ``stacked_experts`` one per projection, the experts along its first
    dimension (Step3Text's ``moe.gate_proj.weight``)."""
    from pytest_enginecheck.targets.vllm.probe import find

    fused_moe = find(FUSED_MOE, "the tiny checkpoint splits fused experts with")
    packed = {**DEFAULT_PACKED, **(getattr(model, "packed_modules_mapping", None) or {})}
    stacked = stacked_shards(model)
    shapes: dict[str, tuple[tuple[int, ...], Any, bool]] = {}
    for name, param in model.named_parameters():
        owner, _, attr = name.rpartition(".")
        module = model.get_submodule(owner)
        norm = "norm" in type(module).__name__.lower() and param.dim() == 1
        if isinstance(module, fused_moe):
            for ckpt_name, shape in _expert_shapes(model, module, name, attr, param, stacked_experts):
                shapes[unmapped_name(model, ckpt_name)] = (shape, param.dtype, False)
            continue
        leaf = owner.rpartition(".")[2]
        sizes = list(getattr(module, "output_sizes", None) or [])
        shards = stacked[leaf] if len(stacked.get(leaf, [])) == len(sizes) > 1 else packed.get(leaf, [leaf])
        if len(shards) > 1 and len(shards) == len(sizes) and owner not in whole:
            dim = getattr(param, "output_dim", 0)
            for shard, size in zip(shards, sizes, strict=True):
                shape = tuple(size if d == dim else n for d, n in enumerate(param.shape))
                shapes[unmapped_name(model, f"{owner[: -len(leaf)]}{shard}.{attr}")] = (shape, param.dtype, False)
            continue
        shapes[unmapped_name(model, name)] = (tuple(param.shape), param.dtype, norm)
    return shapes


def stacked_shards(model: Any) -> dict[str, list[str]]:
    """The checkpoint shards of packed layers that a ``hf_to_vllm_mapper`` of ``model`` or of one of its modules
    stacks (``orig_to_new_stacked``: TeleChat2Model's ``.query`` -> ``(.qkv_proj, "q")``), by packed layer, in shard
    order (q, k, v; 0, 1): the hub's names, where the model's packed_modules_mapping names vLLM's usual ones. Only
    rules of one module name to one (no path), and only layers whose every shard one name gives."""
    order = {"q": 0, "k": 1, "v": 2}
    stacked: dict[str, dict[int, set[str]]] = {}
    for module in model.modules():
        rules = getattr(getattr(module, "hf_to_vllm_mapper", None), "orig_to_new_stacked", None) or {}
        for orig, (new, shard) in rules.items():
            one_name = "." not in orig.strip(".") and "." not in new.strip(".")
            if one_name and (not isinstance(shard, str) or shard in order):
                index = order[shard] if isinstance(shard, str) else int(shard)
                stacked.setdefault(new.strip("."), {}).setdefault(index, set()).add(orig.strip("."))
    return {layer: [next(iter(shards[i])) for i in sorted(shards)] for layer, shards in stacked.items()
            if all(len(names) == 1 for names in shards.values())}


def _expert_shapes(model: Any, moe: Any, name: str, attr: str, param: Any, stacked: bool = False
                   ) -> Iterator[tuple[str, tuple[int, ...]]]:
    """The per-expert checkpoint tensors of a fused MoE parameter ``name`` (``w13_weight``: each expert's gate and up
    projections, halves of its second dimension; ``w2_weight``: each expert's down projection), named as the
    mapping names them below the MoE block (the module above ``.experts.``). ``stacked``: one tensor per projection
    of all the experts, named without the expert (``experts.0.gate_proj.`` -> ``gate_proj.``)."""
    block = name[: name.rfind(".experts.") + 1]
    seen: set[str] = set()
    for param_part, weight_part, _expert, shard in expert_mapping(model, moe):
        token = param_part.rpartition(".")[2]  # "w13_"
        if not attr.startswith(token):
            continue
        per_expert = tuple(param.shape[1:])
        if shard in ("w1", "w3") and per_expert and attr.startswith("w13_"):
            per_expert = (per_expert[0] // 2, *per_expert[1:])
        if stacked:
            weight_part = re.sub(r"(^|\.)experts\.\d+\.", r"\1", weight_part)
            per_expert = (param.shape[0], *per_expert)
        if (weight_part.startswith("experts.") or stacked) and block:
            ckpt_name = f"{block}{weight_part}{attr[len(token):]}"
        else:
            ckpt_name = name.replace(param_part, weight_part, 1)
        if ckpt_name not in seen:
            seen.add(ckpt_name)
            yield ckpt_name, per_expert


def _unchanged(params: Mapping[str, Any], before: Mapping[str, Any]) -> bool:
    """Whether every parameter of ``params`` equals its copy in ``before``, a NaN (a parameter the round trip left
    unloaded) equal to a NaN."""
    import torch

    return all(torch.equal(torch.nan_to_num(p, nan=math.inf), torch.nan_to_num(before[n], nan=math.inf))
               for n, p in params.items())


def _consumed_name(model: Any, name: str, shape: tuple[tuple[int, ...], Any, bool]) -> str | None:
    """The name, one module shorter than ``name``, under which ``load_weights`` takes a tensor of ``shape``
    (IQuestLoopCoder's ``gate_projections.0.weight``, which its loader maps to the parameter
    ``gate_projections.0.gate_proj.weight``): the first that changes a parameter, None where none does."""
    import torch

    params = dict(model.named_parameters())
    parts = name.split(".")
    for i in range(len(parts) - 2, 0, -1):  # never the tensor's own attribute, never the top module, never an index
        if parts[i].isdigit():
            continue
        candidate = ".".join(parts[:i] + parts[i + 1:])
        tensor = _random(*shape) - 1  # other values than any parameter holds
        before = {n: p.detach().clone() for n, p in params.items()}
        try:
            with torch.no_grad():
                model.load_weights(iter([(candidate, tensor)]))
        except Exception:  # noqa: BLE001 - a name the loader has no parameter for: not this one
            continue
        if not _unchanged(params, before):
            return candidate
    return None


def _prove(model: Any, path: Path) -> None:
    """The round trip: ``load_weights`` of every tensor of ``path``'s model.safetensors into ``model`` (every
    parameter NaN before) loads every parameter wholly, and each tensor, loaded again alone with other values,
    changes a parameter. NoTinyCheckpoint naming what was not loaded or not consumed."""
    import torch
    from safetensors.torch import load_file

    tensors = load_file(str(path / WEIGHTS_FILE))
    params = dict(model.named_parameters())
    with torch.no_grad():
        for p in params.values():
            if p.dtype.is_floating_point:
                p.fill_(math.nan)
        try:
            loaded = model.load_weights(iter(sorted(tensors.items())))
        except Exception as e:  # noqa: BLE001 - the checkpoint the checker wrote is wrong, not the model
            raise NoTinyCheckpoint(f"vLLM's load_weights refuses the tiny checkpoint the checker wrote from its "
                                   f"parameters: {type(e).__name__}: {e}") from None
        unloaded = sorted(n for n, p in params.items() if (loaded is not None and n not in loaded)
                          or (p.dtype.is_floating_point and bool(torch.isnan(p).any())))
        before = {n: p.detach().clone() for n, p in params.items()}
        unconsumed = []
        for name, tensor in sorted(tensors.items()):
            if not tensor.dtype.is_floating_point:
                continue
            try:
                model.load_weights(iter([(name, -tensor - 1)]))  # other values (-t - 1 equals t only at -0.5)
                if _unchanged(params, before):
                    unconsumed.append(name)
                model.load_weights(iter([(name, tensor)]))
            except Exception as e:  # noqa: BLE001 - a loader that takes a tensor only beside others
                raise NoTinyCheckpoint(f"vLLM's load_weights refuses the tiny checkpoint's {name} loaded alone, so "
                                       f"the checker cannot tell it was consumed: {type(e).__name__}: {e}") from None
    if unloaded or unconsumed:
        raise NotRoundTripped(
            unloaded, "the tiny checkpoint written from vLLM's parameters does not round-trip through load_weights: "
            + (f"parameters not (wholly) loaded: {', '.join(unloaded)}" if unloaded else "")
            + ("; " if unloaded and unconsumed else "")
            + (f"tensors written but not consumed: {', '.join(unconsumed)}" if unconsumed else ""), unconsumed)
