"""vLLM's torch.compile'd helpers, compiled once in the process the ranks are forked from.

vLLM compiles a few small functions with inductor at their first call, in every rank of every engine start: the rank
of each token among the log-probabilities (``batched_count_greater_than`` in ``Sampler.gather_logprobs``, every
start that asks for log-probabilities: load, lora, kv_consistency) and, at TP > 1, the vocabulary shard's mask
(``get_masked_input_and_mask`` in ``VocabParallelEmbedding``). On 2 cores that is 8 to 12 s of C++ compilation with
a cold inductor cache, and 1 to 4 s with a warm one, where a tiny model's whole generation takes milliseconds.
Dynamo keeps compiled code in the process and a fork inherits it, so the warm parent compiles them once
(``warm_compiled_helpers``) with the shapes and grad mode the ranks call them with, and every rank forked below it
calls the compiled code. A rank still compiles whatever else it is the first to call, as vLLM would.
"""

from __future__ import annotations

from collections.abc import Callable

# (rows, vocabulary size) of the log-probabilities: a second vocabulary size makes dynamo compile that dimension
# dynamic, so a checkpoint of any vocabulary reuses the code (vLLM marks the rows unbacked itself).
LOGPROB_SHAPES = ((1, 97), (3, 101))
# (vocabulary size, rank, tokens) of the shard masks at TP=2: rank 0 starts at index 0 (dynamo specializes a 0)
# and rank 1 does not, and the second vocabulary pads its shard where the first does not.
SHARD_MASK_CALLS = ((250, 0, 1), (250, 1, 5), (1000, 0, 3), (1000, 1, 7))


def _logprob_ranks() -> None:
    import torch
    from vllm.v1.sample.sampler import Sampler

    for rows, vocab in LOGPROB_SHAPES:
        with torch.inference_mode():  # the sampler's inputs are made in the step, inference tensors
            logprobs = torch.linspace(-5.0, 0.0, rows * vocab).reshape(rows, vocab)
            Sampler.gather_logprobs(logprobs, 1, torch.zeros(rows, dtype=torch.int64))


def _vocab_shard_masks() -> None:
    import torch
    from vllm.model_executor.layers.vocab_parallel_embedding import (
        VocabParallelEmbedding,
        get_masked_input_and_mask,
        pad_vocab_size,
    )

    for vocab, rank, tokens in SHARD_MASK_CALLS:
        padded = pad_vocab_size(vocab)
        shard = VocabParallelEmbedding._get_indices(padded, padded, vocab, vocab, rank, 2)
        # the runner's input buffer: int32, made before the step (not an inference tensor)
        token_ids = torch.arange(tokens, dtype=torch.int32)
        with torch.inference_mode():
            get_masked_input_and_mask(token_ids, shard.org_vocab_start_index, shard.org_vocab_end_index,
                                      shard.num_org_vocab_padding, shard.added_vocab_start_index,
                                      shard.added_vocab_end_index)


HELPERS: tuple[Callable[[], None], ...] = (_logprob_ranks, _vocab_shard_masks)


def warm_compiled_helpers() -> list[str]:
    """Call each of HELPERS as a rank calls it: under ``torch.inference_mode``, on inputs made as the rank's are and at
    torch's thread count (dynamo guards on all three), on inputs too small for an eager parallel region. Inductor
    compiles in this process (no worker pool left behind) and emits single-threaded kernels: a parent that ran an
    OpenMP parallel region leaves its forked ranks hanging at their first one. The names of those compiled; one whose
    vLLM function is missing or whose call fails is left out, and each rank compiles it itself, as before: only time
    is lost."""
    import torch._inductor.config as inductor_config

    compile_threads, kernel_threads = inductor_config.compile_threads, inductor_config.cpp.threads
    inductor_config.compile_threads = 1
    inductor_config.cpp.threads = 1
    compiled = []
    try:
        for helper in HELPERS:
            try:
                helper()
            except Exception:  # noqa: BLE001 - an optimization: the ranks compile it themselves
                continue
            compiled.append(helper.__name__.lstrip("_"))
    finally:
        inductor_config.compile_threads, inductor_config.cpp.threads = compile_threads, kernel_threads
    return compiled
