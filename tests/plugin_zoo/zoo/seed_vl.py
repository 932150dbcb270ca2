"""A vision-language model built on zoo.seed_lm (the seed bug's top module)."""

from zoo.seed_lm import SeedLanguageModel


class SeedVLForConditionalGeneration(SeedLanguageModel):
    supports_multimodal = True
