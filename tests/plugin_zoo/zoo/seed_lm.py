"""A language model whose MoE layer comes from zoo.expert_parallel."""

from zoo.base import TinyModel
from zoo.expert_parallel import EXPERTS_PER_DEVICE


class SeedLanguageModel(TinyModel):
    experts_per_device = EXPERTS_PER_DEVICE
