"""Will it fit on the real engine? vLLM's full-size memory per rank, predicted on a CPU from vLLM's own code.

One file per concept, the pure ones first (they import neither torch nor vLLM):

- ``estimates``: the terms only a GPU measures (the profile run's activation peak, measured on fake tensors or by
  formula; non-torch memory, CUDA graphs), each a stated estimate with the range it implies.
- ``sizing``: vLLM's ``determine_available_memory`` arithmetic on those terms.
- ``report``: a prediction (``FitReport``, one ``RankFit`` per rank), as vLLM's log lines and as JSON.
- ``engine_config``: vLLM's config objects (``VllmConfig``) of a user's config.json at TP=N, as ``vllm serve``
  would make them on a GPU.
- ``rank_model``: vLLM's own model class built for rank r of N on the meta device (a rank view of vLLM's TP group).
- ``profile_run``: vLLM's profile run on that model on fake tensors: the activation peak, measured.
- ``kv_cache``: each layer's KV-cache spec, and vLLM's own grouping, block count and ``max_model_len`` search.
- ``predict``: the whole prediction (``predict_fit``) and the smallest TP size that fits.
- ``command``: the target's side of ``python -m pytest_enginecheck.fit --engine vllm`` (``docs/fit.md``).
- ``full_size``: which full-size config.json an architecture has, for budget[tp=N] (``checks/full_size.py``).
"""

from __future__ import annotations

PARALLEL_STATE = "vllm.distributed.parallel_state"
# vLLM's groups a rank of a TP-only engine belongs to with all its TP peers (pipeline, data, context parallel: 1)
RANK_GROUPS = ("_TP", "_WORLD", "_EP")


class FitError(ValueError):
    """The prediction cannot be made from this input; the message names the value and what to change."""
