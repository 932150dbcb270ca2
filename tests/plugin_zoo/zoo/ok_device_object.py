"""A torch.device object touches nothing."""

import torch

from zoo.base import TinyModel

DEFAULT_DEVICE = torch.device("cuda")
SECOND_DEVICE = torch.device("cuda", 1)


class Model(TinyModel):
    pass
