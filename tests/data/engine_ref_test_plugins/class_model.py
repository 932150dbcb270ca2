"""A class-registered out-of-tree model: Llama under another architecture name."""

from typing import ClassVar

from engine_ref.model_executor.models.llama import LlamaForCausalLM


class OotClassLlamaForCausalLM(LlamaForCausalLM):
    """Llama's layers and weights; only the architecture name differs."""

    example_config: ClassVar[dict] = {**LlamaForCausalLM.example_config, "architectures": ["OotClassLlamaForCausalLM"]}
