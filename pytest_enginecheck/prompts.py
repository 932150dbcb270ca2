"""The prompts an engine check generates from, shaped to reach what the engine does with its inputs.

Three prompts of 3, 8 and 17 tokens with 6 generated tokens reach position 22 of a 128-token model, never decode
across a KV block boundary and never come near max_model_len, so a bug that shows only there (a rotary table that
ends at position 63, a decode step that opens a new block) passes every oracle. ``prompt_lengths`` derives them from
the engine's KV block size, its max_model_len and the tokens generated (``max_tokens``), and a check runs them all in
one batch of different lengths:

0. a short prompt (3 tokens), inside the first block;
1. one that ends 3 tokens before the first block boundary: its decode step 4 writes the first slot of block 1;
2. one a token past the first block, so its prefill spans two blocks: ``DIAGNOSIS_PROMPT``, the one the hooked
   forwards run (short, so a module-by-module capture stays small and its messages short);
3. one that ends a token before the last block boundary up to max_model_len / 2: its decode crosses it at step 2;
4. the longest: its last generated token sits at the last position max_model_len allows (or the one before).

No length is a multiple of the block size (every prefill ends inside a block). The tokens (``prompt_tokens``) avoid
the ids a config gives a role (``special_token_ids``: a multimodal model reads its image token as an image) and,
where the caller knows only the vocabulary's size, the ids where vocabularies keep them: the first three (pad, bos,
eos) and the last sixteenth (added tokens: llava's image token is the last id of the bundled one, 255 of 256). Each
prompt starts elsewhere in the vocabulary, so no two share a prefix: a sequence that reads another's keys reads
other values.

engine_ref's load and lora checks run all five (``tiny_engine.prompts``); vLLM's checks run prompts 1, 2 and 4
(``targets/vllm/engine/drive.py``); the quant check keeps ``short_prompts`` (quant_check.py says why).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Any

SHORT = 3  # tokens of the short prompt
SHORT_LENGTHS = (3, 8, 17)  # the prompts every check ran before prompt_lengths; the quant check's still
RESERVED_LOW, RESERVED_HIGH = 3, 16  # the first 3 ids and the last 1/16 of a vocabulary: where special ids sit
BEFORE_BOUNDARY = 3  # how many tokens before the first block boundary prompt 1 ends
DIAGNOSIS_PROMPT = 2  # the index of the prompt a hooked forward runs


class PromptError(ValueError):
    """Settings under which no prompt can be generated from."""


def prompt_lengths(block_size: int, max_model_len: int, max_tokens: int) -> list[int]:
    """The lengths of the five prompts (this module's docstring) for an engine with KV blocks of ``block_size``
    tokens and ``max_model_len``, each generating ``max_tokens`` tokens: each at least 1 and at most
    ``max_model_len - max_tokens``, none a multiple of ``block_size`` (where one can be avoided)."""
    longest = max_model_len - max_tokens
    if block_size < 1 or max_tokens < 1 or longest < 1:
        raise PromptError(f"no prompt fits block_size={block_size}, max_model_len={max_model_len} and max_tokens="
                          f"{max_tokens}: give a block_size and max_tokens of at least 1 and a max_model_len above "
                          f"max_tokens.")
    before = max(1, min(BEFORE_BOUNDARY, max_tokens - 2))  # decode writes positions p .. p + max_tokens - 2
    middle = max(1, max_model_len // 2 // block_size) * block_size
    wanted = [SHORT, block_size - before, block_size + 1, middle - 1, longest]
    lengths = [min(max(n, 1), longest) for n in wanted]
    return [n - 1 if n % block_size == 0 and n > 1 and block_size > 1 else n for n in lengths]  # 1 divides any n


def special_token_ids(config: Mapping[str, Any]) -> set[int]:
    """The token ids a config.json gives a role (keys ending in ``token_id``, ``token_ids`` or ``token_index``:
    image placeholders, bos, eos, pad), at its top level and in every sub-config."""
    found: set[int] = set()
    for key, value in config.items():
        if isinstance(value, Mapping):
            found |= special_token_ids(value)
        elif key.endswith(("token_id", "token_ids", "token_index")):
            values = value if isinstance(value, list) else [value]
            found |= {v for v in values if isinstance(v, int) and not isinstance(v, bool)}
    return found


def short_prompts(vocab_size: int) -> list[list[int]]:
    """Three prompts of SHORT_LENGTHS tokens, ``(7 i + 3) mod vocab_size``, as every check ran before
    ``prompt_lengths``: the quant check's, whose first-order error bound the long ones break (quant_check.py)."""
    return [[(7 * i + 3) % vocab_size for i in range(n)] for n in SHORT_LENGTHS]


def prompt_tokens(lengths: list[int], vocab_size: int, avoid: Collection[int] = ()) -> list[list[int]]:
    """A prompt of each of ``lengths`` inside ``[0, vocab_size)`` without the ids of ``avoid`` (and, where the
    vocabulary leaves enough, without its first RESERVED_LOW and last 1/RESERVED_HIGH), each starting elsewhere in
    the vocabulary."""
    usual = range(RESERVED_LOW, vocab_size - vocab_size // RESERVED_HIGH)
    allowed = [t for t in (usual if len(usual) >= RESERVED_HIGH else range(vocab_size)) if t not in avoid]
    if not allowed:
        raise PromptError(f"no token id of a vocabulary of {vocab_size} is left once the config's special ids "
                          f"{sorted(avoid)[:5]} are avoided: give the checkpoint a vocab_size above them.")
    return [[allowed[(7 * i + 3 + 61 * k) % len(allowed)] for i in range(n)] for k, n in enumerate(lengths)]
