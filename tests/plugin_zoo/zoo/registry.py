"""An out-of-tree engine_ref registry (``--enginecheck-target=zoo.registry:REGISTRY``): every check applies."""

from engine_ref.model_executor.models.registry import _ModelRegistry

REGISTRY = _ModelRegistry({})
REGISTRY.register_model("BadShardLlamaForCausalLM", "zoo.engine_models:BadShardLlamaForCausalLM")
REGISTRY.register_model("TempLeakLlamaForCausalLM", "zoo.engine_models:TempLeakLlamaForCausalLM")
REGISTRY.register_model("ProcessLeakLlamaForCausalLM", "zoo.engine_models:ProcessLeakLlamaForCausalLM")
