"""General plugin 'half': registers an out-of-tree architecture, then raises (the architecture it registered
is lost: an engine does not start with a plugin that failed)."""

from engine_ref_test_plugins import CALLS

ARCHITECTURE = "HalfRegisteredLlamaForCausalLM"


def register() -> None:
    from engine_ref import ModelRegistry

    CALLS.append("half")
    ModelRegistry.register_model(ARCHITECTURE, "engine_ref_test_plugins.oot_model:OotLlamaForCausalLM")
    raise RuntimeError("plugin half broken on purpose after registering: 4471")
