"""General plugin 'warm_only': works only where another module already imported engine_ref's registry
(a warm process), and fails in a fresh interpreter where it is the first thing to run: the bug under test."""

import engine_ref


def register() -> None:
    engine_ref.model_executor.models.registry.ModelRegistry.register_model(
        "WarmOnlyForCausalLM", "engine_ref_test_plugins.oot_model:OotLlamaForCausalLM")
