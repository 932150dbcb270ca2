"""General plugin 'class': registers an architecture as a class (importing its model here)."""

from engine_ref_test_plugins import CALLS

ARCHITECTURE = "OotClassLlamaForCausalLM"


def register() -> None:
    from engine_ref import ModelRegistry
    from engine_ref_test_plugins.class_model import OotClassLlamaForCausalLM

    ModelRegistry.register_model(ARCHITECTURE, OotClassLlamaForCausalLM)
    CALLS.append("class")
