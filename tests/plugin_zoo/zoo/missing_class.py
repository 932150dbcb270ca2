"""Imports cleanly, but the class the registry names was renamed."""

from zoo.base import TinyModel


class RenamedModel(TinyModel):
    pass
