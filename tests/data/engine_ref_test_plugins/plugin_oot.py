"""General plugin 'oot': registers an out-of-tree architecture, lazily (imports no model here)."""

from engine_ref_test_plugins import CALLS

ARCHITECTURE = "OotLlamaForCausalLM"


def register() -> None:
    from engine_ref import ModelRegistry

    ModelRegistry.register_model(ARCHITECTURE, "engine_ref_test_plugins.oot_model:OotLlamaForCausalLM")
    CALLS.append("oot")
