"""The second module of the chain: asks CUDA for the current device at import time (the bug)."""

import torch

DEVICE = torch.cuda.current_device()
