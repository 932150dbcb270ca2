"""vLLM's own engine on N CPU ranks; this package knows no check.

- ``run``: ``run_engine``, the one entry point: the warm layout (ranks forked from this process) or vLLM's own.
- ``ranks``: the warm layout's rank processes, their deadline, logs and shared memory.
- ``cuda_ranks``: --enginecheck-strict in those ranks: the model's own code under the CUDA guard, vLLM's let through.
- ``drive``: one ``LLM`` in this process: start, generate (with a LoRA adapter too), worker RPCs, memory, shutdown.
- ``dtype``: the dtype a checkpoint is started in (bfloat16 for MLA attention).
- ``compiled``: vLLM's torch.compile'd helpers, compiled once in the warm parent (``warm`` preloads it) for every rank.
- ``memory``: each rank's memory by category; ``ranklog``: a rank's output trimmed to what concerns its outcome.
"""
