from zoo.base import TinyModel

raise ValueError("rope_scaling type 'zigzag' is not supported by this zoo model")


class Model(TinyModel):
    pass
