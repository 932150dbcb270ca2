"""The planted bugs' clean twin: Llama exactly, under a name of the zoo's."""

from __future__ import annotations

from typing import ClassVar

from engine_ref.model_executor.models.llama import LlamaForCausalLM


class CleanTwinLlamaForCausalLM(LlamaForCausalLM):
    example_config: ClassVar[dict] = {**LlamaForCausalLM.example_config,
                                      "architectures": ["CleanTwinLlamaForCausalLM"]}
