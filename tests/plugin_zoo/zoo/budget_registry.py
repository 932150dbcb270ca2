"""``zoo.budget_registry:REGISTRY``: budget[tp=N]'s workload bugs and their clean twins (zoo/planted_budget.py,
tests/pytest_enginecheck/test_budget_workload.py)."""

from engine_ref.model_executor.models.registry import _ModelRegistry

REGISTRY = _ModelRegistry({})
for _name in ("DecodeScratchLlamaForCausalLM", "LeakyForwardLlamaForCausalLM", "FreedScratchLlamaForCausalLM",
              "StepScratchLlamaForCausalLM", "CachedWorkspaceLlamaForCausalLM"):
    REGISTRY.register_model(_name, f"zoo.planted_budget:{_name}")
