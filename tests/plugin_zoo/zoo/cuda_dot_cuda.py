import torch

from zoo.base import TinyModel

INV_FREQ = torch.ones(8).cuda()


class Model(TinyModel):
    pass
