import torch

from zoo.base import TinyModel

HAS_GPU = torch.cuda.is_available()


class Model(TinyModel):
    pass
