"""Tries CUDA at import and falls back to CPU when it fails: the GPU host still initialized it."""

import torch

from zoo.base import TinyModel

try:
    BUFFER = torch.empty(4, device="cuda")
except Exception:
    BUFFER = torch.empty(4)


class Model(TinyModel):
    pass
