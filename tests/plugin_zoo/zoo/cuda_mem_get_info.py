import torch

from zoo.base import TinyModel

FREE_BYTES, TOTAL_BYTES = torch.cuda.mem_get_info()


class Model(TinyModel):
    pass
