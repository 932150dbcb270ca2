"""``zoo.reference_registry:REGISTRY``: the reference oracle's planted bugs and clean twins (zoo/planted_reference.py,
tests/pytest_enginecheck/test_reference_oracle.py)."""

from engine_ref.model_executor.models.registry import _ModelRegistry

REGISTRY = _ModelRegistry({})
for _name in ("CleanRefLlamaForCausalLM", "SwapLayersRefLlamaForCausalLM", "RopeDefaultRefLlamaForCausalLM",
              "TiedHeadRefLlamaForCausalLM", "OverwrittenNormRefLlamaForCausalLM", "GeluRefLlamaForCausalLM",
              "ScaledEmbedLlamaForCausalLM", "ScaledEmbedWrongRefLlamaForCausalLM", "NoRefLlamaForCausalLM"):
    REGISTRY.register_model(_name, f"zoo.planted_reference:{_name}")
