"""A plugin package whose __init__ asks how many GPUs there are (cuInit on a GPU host): strict mode blames it."""

import torch

HAS_GPU = torch.cuda.device_count() > 0


def register() -> None:
    pass
