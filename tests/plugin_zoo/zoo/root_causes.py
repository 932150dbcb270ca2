"""An engine_ref registry (``--enginecheck-target=zoo.root_causes:REGISTRY``) of models with one root cause each:
a module that initialises CUDA at import, and a model whose constructor raises. The root check fails; the checks
that depend on it say so instead of repeating it."""

from engine_ref.model_executor.models.registry import _ModelRegistry

REGISTRY = _ModelRegistry({})
REGISTRY.register_model("CudaAtImportLlamaForCausalLM", "zoo.cuda_llama:CudaAtImportLlamaForCausalLM")
REGISTRY.register_model("BrokenBuildLlamaForCausalLM", "zoo.broken_build:BrokenBuildLlamaForCausalLM")
