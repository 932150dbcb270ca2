"""The smallest class the registry accepts as a model: forward() and load_weights()."""

import torch


class TinyModel(torch.nn.Module):
    """A model class for the zoo; never built, only imported and inspected."""

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return input_ids

    def load_weights(self, weights: object) -> set[str]:
        return set()
