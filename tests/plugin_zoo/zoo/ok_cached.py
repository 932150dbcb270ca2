"""The recommended form: a lazy, cached capability function."""

import functools

import torch

from zoo.base import TinyModel


@functools.cache
def device_capability() -> tuple[int, int]:
    return torch.cuda.get_device_capability()


class Model(TinyModel):
    pass
