"""An architecture's reference implementation: what the load checks hold a model's output to, on every target.

The reference (``find_reference``) is what the model class declares in its ``enginecheck_reference`` attribute (a
transformers class name, or ``"module:Class"`` of a model class with ``from_pretrained``: an attribute the engines
never read), else transformers' class of the architecture's own name. Never a base class of another architecture: a
subclass that computes something else on purpose would fail against it. Without either, the architecture is held
to self-consistency only, and its result says so. Imports transformers only when asked.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REFERENCE_ATTRIBUTE = "enginecheck_reference"

class ReferenceDeclarationError(Exception):
    """The reference a model class declares cannot be loaded; the message names the value and the fix."""


@dataclass(frozen=True)
class Reference:
    """An architecture's reference implementation: a transformers-style model class (``from_pretrained``)."""

    name: str  # as the verdict says it: "transformers' LlamaForCausalLM", "the declared mypkg.ref:MyLlama"
    cls: Any  # a model class with from_pretrained


def find_reference(architecture: str, model_cls: type) -> Reference | None:
    """The reference the class declares (``enginecheck_reference``), else transformers' class named
    ``architecture``; None where there is neither. ReferenceDeclarationError for a declaration that does not resolve."""
    declared = getattr(model_cls, REFERENCE_ATTRIBUTE, None)
    if declared is not None:
        return _declared(architecture, declared)
    try:
        import transformers
    except ImportError:
        return None
    try:
        found = getattr(transformers, architecture, None)
    except Exception:  # noqa: BLE001 - transformers' lazy import of that modeling module failed: no reference here
        return None
    return Reference(f"transformers' {architecture}", found) if isinstance(found, type) else None


def _declared(architecture: str, value: object) -> Reference:
    fix = (f"set {REFERENCE_ATTRIBUTE} on {architecture}'s class to a transformers class name (\"LlamaForCausalLM\") "
           f"or to \"module:Class\" of a model class with from_pretrained")
    if isinstance(value, type):
        return Reference(f"the declared {value.__module__}.{value.__qualname__}", value)
    if not isinstance(value, str) or not value:
        raise ReferenceDeclarationError(f"{architecture}.{REFERENCE_ATTRIBUTE} = {value!r}: {fix}")
    module, _, name = value.rpartition(":")
    try:
        found = getattr(importlib.import_module(module or "transformers"), name, None)
    except Exception as e:  # noqa: BLE001 - told with the declaration that named it
        raise ReferenceDeclarationError(f"{architecture}.{REFERENCE_ATTRIBUTE} = {value!r} cannot be imported "
                             f"({type(e).__name__}: {e}): {fix}") from None
    if not isinstance(found, type) or not hasattr(found, "from_pretrained"):
        raise ReferenceDeclarationError(f"{architecture}.{REFERENCE_ATTRIBUTE} = {value!r} is not a model class: {fix}")
    where = "transformers'" if not module else "the declared"
    return Reference(f"{where} {value if module else name}", found)


def load_reference(reference: Reference, ckpt: Path) -> Any:
    """The reference model of the checkpoint at ``ckpt``, float32, eager attention, in eval mode (transformers'
    progress bar and load report silenced: what the reference did not load shows in its outputs)."""
    import torch
    from transformers.utils import logging as hf_logging

    verbosity, bars = hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        try:
            model = reference.cls.from_pretrained(str(ckpt), dtype=torch.float32, attn_implementation="eager")
        except TypeError:  # a model class of the author's that takes neither keyword
            model = reference.cls.from_pretrained(str(ckpt))
    finally:
        hf_logging.set_verbosity(verbosity)
        if bars:
            hf_logging.enable_progress_bar()
    return model.float().eval()
