"""The tiny configs' float32, in the field the installed transformers reads and saves.

transformers 4.56 renamed a config's ``torch_dtype`` to ``dtype``. An older transformers (vLLM 0.9 to 0.11 allow
one) reads ``torch_dtype``, and saves an unknown ``dtype`` attribute verbatim: a ``torch.float32`` there makes
``save_pretrained`` fail ("Object of type dtype is not JSON serializable"), so no tiny checkpoint can be written.
"""

from __future__ import annotations

import functools
from typing import Any

RENAMED_IN = (4, 56)  # the transformers release whose configs carry ``dtype`` instead of ``torch_dtype``


@functools.cache
def dtype_field() -> str:
    """``dtype`` on transformers >= 4.56, ``torch_dtype`` before."""
    import transformers
    from packaging.version import Version

    return "dtype" if Version(transformers.__version__).release[:2] >= RENAMED_IN else "torch_dtype"


def set_float32(config: Any, as_torch_dtype: bool = False) -> None:
    """Set ``config``'s dtype to float32 (the string, or ``torch.float32`` where transformers' modeling code reads it
    as a torch.dtype) in the field the installed transformers knows."""
    value: Any = "float32"
    if as_torch_dtype:
        import torch

        value = torch.float32
    setattr(config, dtype_field(), value)
