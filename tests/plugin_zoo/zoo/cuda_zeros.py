import torch

from zoo.base import TinyModel

WORKSPACE = torch.zeros(16, device="cuda")


class Model(TinyModel):
    pass
