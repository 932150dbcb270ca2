"""CUDA calls inside functions that import does not call."""

import torch

from zoo.base import TinyModel


def allocate_workspace() -> torch.Tensor:
    torch.cuda.set_device(0)
    return torch.zeros(16, device="cuda")


class Model(TinyModel):
    def warm_up(self) -> None:
        torch.cuda.synchronize()
        torch.ones(1).cuda()
