"""What SGLang needs of an ``EntryClass`` class to serve it, read from SGLang 0.5's own code:

- resolved by name: ``registry.import_model_classes`` keys each class by ``cls.__name__`` and
  ``ModelRegistry.resolve_model_cls`` looks the checkpoint's ``architectures`` up by that key, so the class
  must be a class whose ``__name__`` is the architecture;
- built: ``model_loader/loader.py: _initialize_model`` calls ``model_class(config=hf_config,
  quant_config=quant_config)`` (keywords; other arguments only under opt-in settings);
- loaded: ``DefaultModelLoader.load_weights_only`` calls ``model.load_weights(weights)`` with one iterable of
  (name, tensor);
- run: ``model_executor/runner/eager_runner.py`` calls ``model.forward(forward_batch.input_ids,
  forward_batch.positions, forward_batch, **kwargs)``, kwargs only what the signature accepts
  (``pp_proxy_tensors`` when ``model_runner`` finds it in ``inspect.signature(model.forward)``) or what the
  request brings (``input_embeds``; ``get_embedding=True`` for an embedding model).

``unmet`` checks these on the class itself, without building it (no config, no weights, no CUDA). SGLang only
ever calls ``model.forward`` on the built instance, so a class may leave ``forward`` to the instance: SGLang's own
wrappers assign ``self.forward = self.thinker.forward`` in ``__init__`` (Qwen3-Omni, dots.note) or delegate every
attribute to the model they build through ``__getattr__`` (MiniCPM-V, not even a ``torch.nn.Module``). Such a
forward cannot be bound without building the model; ``forward_source`` says which it is, and only a class with
none of the three fails.
"""

from __future__ import annotations

import ast
import inspect
import textwrap
from typing import Any

SENTINEL = object()  # stands for an argument's value when binding a signature


def _binds(function: Any, *args: Any, **kwargs: Any) -> str | None:
    """None when ``function`` can be called with these arguments, else why not."""
    try:
        signature = inspect.signature(function)
    except (TypeError, ValueError) as e:
        return f"its signature cannot be read ({e})"
    try:
        signature.bind(*args, **kwargs)
    except TypeError as e:
        return f"{signature} does not take them ({e})"
    return None


def _method(cls: type, name: str) -> tuple[Any, tuple[Any, ...]] | None:
    """The method ``name`` as the class holds it, and the arguments binding an instance takes first."""
    static = inspect.getattr_static(cls, name, None)
    if static is None:
        return None
    if isinstance(static, staticmethod):
        return static.__func__, ()
    if isinstance(static, classmethod):
        return getattr(cls, name), ()
    return static, (SENTINEL,)


def _assigns_forward(cls: type) -> bool:
    """Whether an ``__init__`` of the class or a base (its source) assigns ``self.forward``."""
    for klass in cls.__mro__:
        init = klass.__dict__.get("__init__")
        if init is None or klass.__module__.startswith("torch."):
            continue
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(init)))
        except (OSError, TypeError, SyntaxError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Assign) and any(
                    isinstance(t, ast.Attribute) and t.attr == "forward" and isinstance(t.value, ast.Name)
                    and t.value.id == "self" for t in node.targets):
                return True
    return False


def forward_source(cls: type) -> str:
    """Where an instance's ``forward`` comes from: "class" (defined by the class or a base, bindable), "init" (its
    ``__init__`` assigns ``self.forward``), "getattr" (``__getattr__`` delegates it), or "none"."""
    import torch

    defined = _method(cls, "forward")
    if defined is not None and defined[0] is not torch.nn.Module.forward:
        return "class"
    if _assigns_forward(cls):
        return "init"
    if "__getattr__" in {name for klass in cls.__mro__ if not klass.__module__.startswith("torch.")
                         for name in klass.__dict__}:
        return "getattr"
    return "none"


def unmet(cls: Any, architecture: str) -> list[str]:
    """The requirements (module docstring) ``cls`` does not meet, as sentences naming what to change."""
    if not isinstance(cls, type):
        return [f"EntryClass holds {cls!r}, not a class: SGLang's registry registers classes by __name__"]
    problems = []
    if cls.__name__ != architecture:
        problems.append(f"its __name__ is {cls.__name__!r}: SGLang's registry serves it as that, not as "
                        f"{architecture!r}")
    why = _binds(cls, config=SENTINEL, quant_config=None)
    if why:
        problems.append(f"SGLang builds it as {cls.__name__}(config=..., quant_config=...): {why}")
    load = _method(cls, "load_weights")
    if load is None:
        problems.append("it has no load_weights: SGLang's loader calls model.load_weights(weights)")
    else:
        why = _binds(load[0], *load[1], SENTINEL)
        if why:
            problems.append(f"SGLang calls model.load_weights(weights): {why}")
    source = forward_source(cls)
    if source == "none":
        problems.append("it has no forward (none defined, none assigned in __init__, no __getattr__): SGLang calls "
                        "model.forward(input_ids, positions, forward_batch)")
    forward = _method(cls, "forward") if source == "class" else None
    if forward is not None:
        why = _binds(forward[0], *forward[1], SENTINEL, SENTINEL, SENTINEL)
        if why:
            problems.append(f"SGLang calls model.forward(input_ids, positions, forward_batch): {why}")
    return problems


def served_with(cls: type) -> dict[str, Any]:
    """What SGLang would pass ``forward`` beyond the three positional arguments, per its signature (where the class
    defines it; else only where forward comes from)."""
    if forward_source(cls) != "class":
        return {"forward": forward_source(cls)}
    try:
        parameters = inspect.signature(getattr(cls, "forward")).parameters  # noqa: B009 - typed as a type
    except (TypeError, ValueError, AttributeError):
        return {}
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values())
    return {"pipeline_parallel": "pp_proxy_tensors" in parameters,
            "input_embeds": takes_any or "input_embeds" in parameters,
            "get_embedding": takes_any or "get_embedding" in parameters}
