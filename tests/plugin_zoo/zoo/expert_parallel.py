"""Sizes expert groups from the device, at import time: the bug."""

import torch

SM_COUNT = torch.cuda.get_device_properties(0).multi_processor_count  # BUG: initializes CUDA
EXPERTS_PER_DEVICE = max(1, SM_COUNT // 16)
