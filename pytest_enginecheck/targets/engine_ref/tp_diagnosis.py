"""When two runs of a model disagree: run it with a hook on every module, and say where and why they differ.

The model is built and run on the same tokens twice, with a forward hook on every module, the model itself (its
own output, after its last submodule) and its compute_logits included (``capture``, filling a tp_explain.Capture):
at TP=1 and on N real gloo ranks (``diagnose``: TP=N against TP=1, once a second TP=N run has reproduced the first),
or at TP=1 under two seeds (``diagnose_seeds``: a model whose output depends on the random number generator).
tp_explain compares the runs and names the first module that differs, and why.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pytest_enginecheck.targets.engine_ref.tp_explain import (
    Capture,
    Diagnosis,
    explain_rerun,
    explain_seeds,
    explain_tp,
)
from pytest_enginecheck.tp_compare import CallKeys, first_tensor, weight_loaders


def _layout(module: Any) -> dict[str, Any] | None:
    from engine_ref.model_executor.layers.linear import LinearBase

    if not isinstance(module, LinearBase):
        return None
    return {"column": module.output_is_sharded, "input_start": module.input_start,
            "shards": {sid: (module.output_shard(sid) if module.output_is_sharded else (0, rows, 0))
                       for sid, rows in module.output_shards.items()}}


def _lm_head_weight(model: Any) -> tuple[Any, list[str]] | None:
    """This rank's rows of the vocabulary in the LM head's weight (its padding rows cut off), and its weight
    loaders; None for a model with no ``lm_head`` module holding a weight."""
    from engine_ref.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding

    head = next((m for n, m in model.named_modules(remove_duplicate=False)  # a tied head is the embedding
                 if n.rsplit(".", 1)[-1] == "lm_head"), None)
    weight = getattr(head, "weight", None)
    if head is None or weight is None:
        return None
    if isinstance(head, VocabParallelEmbedding):
        weight = weight[:max(0, head.vocab_end_index - head.vocab_start_index)]
    return weight.detach().clone(), weight_loaders(head)


def _hook_logits(model: Any, result: Capture, keys: CallKeys) -> None:
    """Record the output of ``model.compute_logits`` (what the model runner calls after the forward) like a
    module's, under ``result.logits``; its parameters are the LM head's (``_lm_head_weight``)."""
    key = result.logits = f"{type(model).__name__}.compute_logits"
    result.classes[key] = "the logits"
    head = _lm_head_weight(model)
    if head is not None:
        result.params[key], result.loaders[key] = {"weight": head[0]}, head[1]
    compute_logits = model.compute_logits

    def hooked(hidden_states: Any) -> Any:
        result.input_shapes[keys.enter(key)] = tuple(hidden_states.shape)
        logits = compute_logits(hidden_states)
        keys.leave()
        result.order.append(key)
        result.outputs[key] = logits.detach().clone()
        return logits

    model.compute_logits = hooked


def capture(rank: int, world_size: int, spec: str, ckpt: str, prompt: list[int], seed: int = 0) -> Capture:
    """Runs on each rank (a multirank child): build and load the model of target ``spec`` under ``seed`` (as a
    worker seeds itself before load_model), run ``prompt`` once with hooks on every module, the model itself
    (keyed by its class name) and its compute_logits."""
    import torch

    from engine_ref.engine.arg_utils import EngineArgs
    from engine_ref.engine.scheduler import ScheduledSequence
    from engine_ref.model_executor.model_loader.loaders import get_model_loader
    from engine_ref.worker.model_runner import ModelRunner
    from pytest_enginecheck.targets.engine_ref.registry import engine_ref_registry

    engine_ref_registry(spec)
    # One thread: the check process that forked this rank has run its own engine, and an OpenMP pool
    # inherited through fork deadlocks at the first parallel region.
    torch.set_num_threads(1)
    config = EngineArgs(model=ckpt, tensor_parallel_size=world_size, device_memory="1GiB", max_model_len=128,
                        distributed_executor_backend="uni" if world_size == 1 else "mp", seed=seed,
                        ).create_engine_config(inspect_in_subprocess=False)
    torch.manual_seed(seed)
    model = get_model_loader(config.load_config).load_model(config, torch.device("cpu"))
    result = Capture()
    keys = CallKeys()
    for name, module in model.named_modules():
        if not name:  # the model itself: its own output, after its last submodule
            name = result.root = type(model).__name__
            result.classes[name] = "the model's own output, after its last submodule"
        else:
            result.classes[name] = type(module).__name__
        layout = _layout(module)
        if layout is not None:
            result.layouts[name] = layout
        own = {p: t.detach().clone() for p, t in module.named_parameters(recurse=False) if p in ("weight", "bias")}
        if own:
            result.params[name] = own
        loaders = weight_loaders(module)
        if loaders:
            result.loaders[name] = loaders

        def pre(mod: Any, args: tuple, name: str = name) -> None:
            key = keys.enter(name)
            first = first_tensor(args)
            if first is not None:
                result.input_shapes[key] = tuple(first.shape)

        def post(mod: Any, args: tuple, output: Any) -> None:
            key = keys.leave()
            first = first_tensor(output)
            if first is not None:
                result.order.append(key)
                result.outputs[key] = first.detach().clone()
            elif output is not None:  # it produced something the comparison cannot read: say so, later
                result.order.append(key)
                result.unreadable[key] = type(output).__name__

        module.register_forward_pre_hook(pre)
        module.register_forward_hook(post)
    _hook_logits(model, result, keys)
    runner = ModelRunner(model, config, torch.device("cpu"))
    torch.manual_seed(seed)
    try:
        with torch.inference_mode():
            runner._run([ScheduledSequence(0, list(prompt), 0, [])], with_cache=False)
    except Exception as e:  # noqa: BLE001 - what failed, and where, is the diagnosis
        result.failed_in = keys.innermost
        result.error = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    return result


def capture_seeds(rank: int, world_size: int, spec: str, ckpt: str, prompt: list[int],
                  seeds: Sequence[int]) -> list[Capture]:
    """``capture`` once per seed, each with a model built afresh (a multirank child)."""
    return [capture(rank, world_size, spec, ckpt, prompt, seed) for seed in seeds]


def diagnose(spec: str, ckpt: Path, tp: int, prompt: list[int], timeout: float = 120.0,
             started: bool = True) -> Diagnosis:
    """Run ``prompt`` with hooks at TP=1 and TP=``tp`` (real ranks) and explain where they differ (``explain_tp``).

    ``started`` (the engine started at TP=``tp``, and its tokens differed): TP=``tp`` is run twice first, and when
    the two runs disagree the Diagnosis says so (``explain_rerun``, ``nondeterministic``) instead of blaming a
    module's weights or collective for a difference that does not reproduce."""
    from pytest_enginecheck.multirank import run_multirank

    (one,) = run_multirank(capture, 1, spec, str(ckpt), prompt, timeout=timeout)
    if one.error is not None:
        return Diagnosis(f"The diagnosis could not run the model with hooks at tensor_parallel_size=1 ({one.error} "
                         f"in {one.failed_in}), so it names no module.")
    ranks = run_multirank(capture, tp, spec, str(ckpt), prompt, timeout=timeout)
    if started:
        rerun = explain_rerun(ranks, run_multirank(capture, tp, spec, str(ckpt), prompt, timeout=timeout), tp)
        if rerun is not None:
            return rerun
    return explain_tp(one, ranks, tp, started)


def diagnose_seeds(spec: str, ckpt: Path, prompt: list[int], seeds: tuple[int, int] = (0, 1)) -> Diagnosis | None:
    """Build and run ``prompt`` with hooks at TP=1 under each of ``seeds``: None when the two runs agree exactly,
    else the first module whose output changes (``explain_seeds``).

    In this process (a check's own child): TP=1 needs no process group, and it costs a tenth of starting a rank.
    """
    import torch

    threads = torch.get_num_threads()
    try:
        with torch.random.fork_rng(devices=[]):
            first, second = capture_seeds(0, 1, spec, str(ckpt), prompt, seeds)
    finally:
        torch.set_num_threads(threads)
    return explain_seeds(first, second, seeds)
