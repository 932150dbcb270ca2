"""``--enginecheck-target=zoo.tp_registry:REGISTRY``: models whose TP=2 differs from TP=1, one cause each."""

from engine_ref.model_executor.models.registry import _ModelRegistry

REGISTRY = _ModelRegistry({})
REGISTRY.register_model("BadShardLlamaForCausalLM", "zoo.engine_models:BadShardLlamaForCausalLM")
REGISTRY.register_model("RowAsColumnLlamaForCausalLM", "zoo.tp_models:RowAsColumnLlamaForCausalLM")
REGISTRY.register_model("NoAllReduceLlamaForCausalLM", "zoo.tp_models:NoAllReduceLlamaForCausalLM")
