"""Activation functions, by the names config.json uses."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from engine_ref.errors import ConfigError


class SiluAndMul(nn.Module):
    """silu(x[..., :d]) * x[..., d:]: the gated MLP's activation over the merged gate_up output."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up


class QuickGELU(nn.Module):
    """x * sigmoid(1.702 x), CLIP's activation."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.sigmoid(1.702 * x)


def get_act_fn(name: str) -> nn.Module:
    """The activation module for a config.json ``hidden_act`` name."""
    acts: dict[str, Callable[[], nn.Module]] = {
        "gelu": lambda: nn.GELU(), "gelu_pytorch_tanh": lambda: nn.GELU(approximate="tanh"),
        "quick_gelu": QuickGELU, "silu": nn.SiLU, "relu": nn.ReLU,
    }
    if name not in acts:
        raise ConfigError(f"activation {name!r} is not supported; use one of {', '.join(acts)}.")
    return acts[name]()


def check_gated_silu(name: str) -> None:
    """The gated MLPs here implement silu only; say so for anything else in config.json."""
    if name != "silu":
        raise ConfigError(f"hidden_act={name!r} is not supported by this gated MLP; only 'silu' is.")
