"""A Llama variant that imports cleanly but cannot be built: its constructor raises (so load, budget and startup
all fail for this one reason)."""

from engine_ref.model_executor.models.llama import LlamaForCausalLM


class BrokenBuildLlamaForCausalLM(LlamaForCausalLM):
    def __init__(self, *args, **kwargs):
        raise ValueError("rope_theta must be set for the broken-build zoo model")
