"""The environment vLLM's CPU engine runs under in a check, the arguments every start gives it, and where its caches
go."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

# Cache locations a check run makes vLLM (and libraries it imports) write to: into the session's
# directory unless the user chose them.
CACHE_VARIABLES = ("VLLM_CACHE_ROOT", "CUTLASS_CACHE_DIR", "FLASHINFER_WORKSPACE_BASE", "TORCHINDUCTOR_CACHE_DIR")
KV_CACHE_GIB = 1  # vLLM's CPU KV cache size (VLLM_CPU_KVCACHE_SPACE) for tiny checkpoints
MAX_MODEL_LEN = 128
# vLLM's CPU default block size is 128, MAX_MODEL_LEN: one block per sequence, so no prompt could cross a boundary.
# 32 is the smallest its CPU attention prefers (multiples of 32); MLA models get 16 and DeepSeek-V4 256 whatever is
# asked (platforms/cpu.py).
BLOCK_SIZE = 32
# vLLM's arguments of every engine start on a tiny checkpoint (and of the config objects its model is built under)
ENGINE_ARGS: dict[str, Any] = {"skip_tokenizer_init": True, "enforce_eager": True, "dtype": "float32",
                               "max_model_len": MAX_MODEL_LEN, "max_num_seqs": 4,
                               "max_num_batched_tokens": MAX_MODEL_LEN, "block_size": BLOCK_SIZE, "seed": 0}


def redirect_caches(workdir: str) -> None:
    """Point the caches vLLM creates into ``workdir`` unless the user set them."""
    for name in CACHE_VARIABLES:
        if name not in os.environ:
            path = Path(workdir) / "caches" / name.lower()
            path.mkdir(parents=True, exist_ok=True)
            os.environ[name] = str(path)


def cpu_engine_env(tp: int) -> dict[str, str]:
    """vLLM's CPU-engine settings for ``tp`` ranks on one NUMA node: one core per rank, round robin."""
    cores = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else set(range(os.cpu_count() or 1))
    ordered = sorted(cores)
    bind = "|".join(str(ordered[rank % len(ordered)]) for rank in range(tp))
    return {"VLLM_TARGET_DEVICE": "cpu", "VLLM_CPU_KVCACHE_SPACE": str(KV_CACHE_GIB),
            "VLLM_CPU_OMP_THREADS_BIND": bind, "HF_HUB_OFFLINE": "1"}
