"""``zoo.reference_registry:REGISTRY``: the reference oracle's planted bugs and clean twins (zoo/planted_reference.py,
tests/pytest_enginecheck/test_reference_oracle.py)."""

from engine_ref.model_executor.models.registry import _ModelRegistry

REGISTRY = _ModelRegistry({})
for _name in ("CleanRefLlamaForCausalLM", "SwapLayersRefLlamaForCausalLM", "RopeDefaultRefLlamaForCausalLM",
              "TiedHeadRefLlamaForCausalLM", "OverwrittenNormRefLlamaForCausalLM", "GeluRefLlamaForCausalLM",
              "ScaledEmbedLlamaForCausalLM", "ScaledEmbedWrongRefLlamaForCausalLM", "NoRefLlamaForCausalLM"):
    REGISTRY.register_model(_name, f"zoo.planted_reference:{_name}")
for _name in ("BorrowedWeightAcctLlamaForCausalLM", "DroppedHeadAcctLlamaForCausalLM",
              "OverwrittenNormAcctLlamaForCausalLM", "ScaledKeyAcctLlamaForCausalLM", "TiedHeadAcctLlamaForCausalLM",
              "UnloadedBufferAcctLlamaForCausalLM", "TiedAcctLlamaForCausalLM", "DerivedParamAcctLlamaForCausalLM",
              "DerivedBufferAcctLlamaForCausalLM"):  # zoo/planted_accounting.py (test_checkpoint_accounting.py)
    REGISTRY.register_model(_name, f"zoo.planted_accounting:{_name}")
for _name in ("ClampedRopeLlamaForCausalLM", "DecodeBlockLlamaForCausalLM",
              "CleanInputsLlamaForCausalLM"):  # zoo/planted_inputs.py (test_input_coverage.py)
    REGISTRY.register_model(_name, f"zoo.planted_inputs:{_name}")
