"""``zoo.redteam_registry:REGISTRY``: red-team planted bugs too slow for the zoo.planted session, tested one check at
a time (tests/pytest_enginecheck/test_redteam.py)."""

from engine_ref.model_executor.models.registry import _ModelRegistry

REGISTRY = _ModelRegistry({})
# load[tp=2] (the engine's words, not the check's timeout; budget[tp=2] and startup fold into it): TP=2 rank 1 hangs
# in layer 1's down_proj weight_loader
REGISTRY.register_model("HangRank1LoadLlamaForCausalLM", "zoo.planted_redteam:HangRank1LoadLlamaForCausalLM")
# load[tp=1] under --enginecheck-strict (its guarded TP=1 build): layer 1 calls torch.cuda.is_available() when built,
# not when imported, so the import check cannot see it
REGISTRY.register_model("CudaQueryBuildLlamaForCausalLM", "zoo.planted_redteam:CudaQueryBuildLlamaForCausalLM")
