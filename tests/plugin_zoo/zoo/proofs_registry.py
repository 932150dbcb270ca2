"""``zoo.proofs_registry:REGISTRY``: planted bugs whose diagnosis must say only what it proved, and their clean
twins (zoo/planted_diagnosis2.py, tests/pytest_enginecheck/test_diagnosis_proofs.py)."""

from engine_ref.model_executor.models.registry import _ModelRegistry

REGISTRY = _ModelRegistry({})
for _name in ("TpNoiseLlamaForCausalLM", "TpDropoutLlamaForCausalLM", "LogitsShardLlamaForCausalLM",
              "OwnLogitsLlamaForCausalLM", "NoisyOutputLlamaForCausalLM", "ZeroNoiseOutputLlamaForCausalLM",
              "UnguardedRankLlamaForCausalLM", "GuardedRankLlamaForCausalLM"):
    REGISTRY.register_model(_name, f"zoo.planted_diagnosis2:{_name}")
