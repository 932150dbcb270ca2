"""The lora check's reference, on every target: the architecture's reference implementation (``reference``:
``find_reference``'s, never a base class of another architecture) wrapped by PEFT with the same adapter the engine
runs. PEFT's ``disable_adapter()`` turns the same object back into the reference without it.

Imports peft and transformers only when asked; where peft cannot be imported, ``peft_unavailable`` says what to
install.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

from pytest_enginecheck.reference import REFERENCE_ATTRIBUTE, Reference, load_reference


def peft_unavailable() -> str | None:
    """Why peft cannot be imported here, with what to install; None where it can."""
    try:
        import peft  # noqa: F401 - imported to learn whether it imports
    except ImportError as e:
        top = (e.name or "peft").split(".")[0]  # peft itself, or a package it imports (accelerate)
        missing = ["peft", *([top] if top != "peft" else [])]
        return (f"peft cannot be imported here ({type(e).__name__}: {e}); install it: pip install {' '.join(missing)} "
                f"(constraints.txt pins peft)")
    return None


def no_reference_why(architecture: str) -> str:
    """Why ``find_reference`` found no reference for ``architecture`` (it returned None)."""
    try:
        import transformers  # noqa: F401 - imported to learn whether it imports
    except ImportError as e:
        return f"transformers cannot be imported here ({e}; pip install transformers)"
    return f"transformers has no class {architecture} and its class declares no {REFERENCE_ATTRIBUTE}"


def load_peft_reference(reference: Reference, ckpt: Path, adapter: Path) -> Any:
    """``reference``'s model of the checkpoint at ``ckpt`` (``load_reference``: float32, eval mode) with the PEFT
    adapter at ``adapter`` on it (``peft.PeftModel.from_pretrained``), in eval mode. Its ``get_base_model()`` is the
    reference model with PEFT's LoRA layers in place, under the reference's own module names."""
    import peft
    from transformers.utils import logging as hf_logging

    model = load_reference(reference, ckpt)
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # its tqdm lock is a named semaphore a check's child would leak
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # transformers' deprecations of what PEFT calls
            return peft.PeftModel.from_pretrained(model, str(adapter)).float().eval()
    finally:
        if bars:
            hf_logging.enable_progress_bar()
