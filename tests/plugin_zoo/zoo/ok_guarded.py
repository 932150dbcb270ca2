"""The guarded form: CUDA only when it is available (never on a CPU host)."""

import torch

from zoo.base import TinyModel

if torch.cuda.is_available():
    WORKSPACE = torch.zeros(16, device="cuda")
else:
    WORKSPACE = torch.zeros(16)


class Model(TinyModel):
    pass
