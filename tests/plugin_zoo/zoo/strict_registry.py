"""``zoo.strict_registry:REGISTRY``: the CUDA accesses only a strict guard in every rank sees, and their clean twin
(zoo/planted_strict.py, tests/pytest_enginecheck/test_strict_ranks.py)."""

from engine_ref.model_executor.models.registry import _ModelRegistry

REGISTRY = _ModelRegistry({})
for _name in ("QueryForwardStrictLlamaForCausalLM", "DotCudaForwardStrictLlamaForCausalLM",
              "QueryBuildTPStrictLlamaForCausalLM", "DecodeQueryStrictLlamaForCausalLM", "CleanStrictLlamaForCausalLM"):
    REGISTRY.register_model(_name, f"zoo.planted_strict:{_name}")
