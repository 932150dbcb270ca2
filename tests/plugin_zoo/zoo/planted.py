"""``--enginecheck-target=zoo.planted:REGISTRY``: one planted bug per model, each away from layer 0 and from the
first check that runs, beside a clean twin that must pass every check. Each bug's model lives in its own
``zoo/planted_*.py`` module; its line here says which check must catch it."""

from engine_ref.model_executor.models.registry import _ModelRegistry

REGISTRY = _ModelRegistry({})
# the clean twin: plain Llama under a zoo name; every check passes
REGISTRY.register_model("CleanTwinLlamaForCausalLM", "zoo.planted_clean:CleanTwinLlamaForCausalLM")
# load (its determinism run): layer 1's MLP adds torch.randn_like noise; TP=1 and TP=2 agree, two seeds do not
REGISTRY.register_model("RngMLPLlamaForCausalLM", "zoo.planted_rng:RngMLPLlamaForCausalLM")
# load[tp=1], the first check whose engine shuts down (every later engine check folds into it): layer 1 starts a
# non-daemon poller thread when built; the process that built it cannot exit by itself at shutdown
REGISTRY.register_model("PollerThreadLlamaForCausalLM", "zoo.planted_thread:PollerThreadLlamaForCausalLM")
# quant (every method, every TP size): layer 1's down_proj multiplies its weight_scale by 1.05 after loading
REGISTRY.register_model("QuantScaleLlamaForCausalLM", "zoo.planted_quant:QuantScaleLlamaForCausalLM")
# load[tp=2] (its diagnosis): layer 1's act_fn returns a padded layout (not comparable) and is wrong at TP=2
REGISTRY.register_model("PaddedActLlamaForCausalLM", "zoo.planted_diag:PaddedActLlamaForCausalLM")
# load[tp=1] and load[tp=2]: layer 1's down_proj is sharded wrongly AND every build leaks a helper process; load[tp=1]
# fails for the leak, load[tp=2] for the sharding (with a line that load[tp=1] failed too), it is not skipped
REGISTRY.register_model("ShardAndLeakLlamaForCausalLM", "zoo.planted_fold:ShardAndLeakLlamaForCausalLM")
# load[tp=2] (beyond its tokens): layer 1's o_proj scales rank 1's shard by 1.01; every greedy token stays the same
REGISTRY.register_model("ScaledShardLlamaForCausalLM", "zoo.planted_scaled_shard:ScaledShardLlamaForCausalLM")
# load[tp=1] (its KV-cache run): layer 1's attention numbers each forward's tokens from 0, so decode rotates as
# position 0; the same at every TP size and in every prefill: only decode against recompute without the cache tells
REGISTRY.register_model("DecodePositionsLlamaForCausalLM", "zoo.planted_redteam:DecodePositionsLlamaForCausalLM")
