import zoo_fused_kernels_not_installed  # noqa: F401

from zoo.base import TinyModel


class Model(TinyModel):
    pass
