"""A Llama variant whose module initialises CUDA at import (the root cause of every check of it failing)."""

import torch

from engine_ref.model_executor.models.llama import LlamaForCausalLM

WORKSPACE = torch.zeros(16, device="cuda")


class CudaAtImportLlamaForCausalLM(LlamaForCausalLM):
    pass
