"""``--enginecheck-target=zoo.planted:REGISTRY``: one planted bug per model, each away from layer 0 and from the
first check that runs, beside a clean twin that must pass every check. Each bug's model lives in its own
``zoo/planted_*.py`` module; its line here says which check must catch it."""

from engine_ref.model_executor.models.registry import _ModelRegistry

REGISTRY = _ModelRegistry({})
# the clean twin: plain Llama under a zoo name; every check passes
REGISTRY.register_model("CleanTwinLlamaForCausalLM", "zoo.planted_clean:CleanTwinLlamaForCausalLM")
