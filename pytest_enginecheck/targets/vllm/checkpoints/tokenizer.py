"""The tiny tokenizer the checker writes beside a tiny checkpoint, for the architectures vLLM cannot start without one.

The engine checks start vLLM with ``skip_tokenizer_init=True`` and prompt token ids (engine.ENGINE_ARGS): most models
never read a tokenizer. A few do, even then, and the checker writes one for those alone (``tokenizer_reason``):

- a multimodal processor vLLM builds (the checker does not start the model ``language_model_only``: an
  encoder-decoder, Whisper) whose class says ``requires_tokenizer`` (vLLM's BaseMultiModalProcessor);
- vLLM's code that reads the tokenizer when the engine or the model is built (TOKENIZER_READERS: a renderer of the
  tokenizer mode vLLM picks for the architecture, a model whose ``__init__`` looks up a special token's id).

The tokenizer is byte-level BPE without merges over the printable ASCII bytes (BYTE_TOKENS: ids 0 to 94), then the
special tokens that code looks up; real files written by transformers' ``save_pretrained`` (Whisper's by its own
WhisperProcessor, with a WhisperFeatureExtractor sized to the tiny encoder), the same bytes every time. A checkpoint
with it holds TOKENIZER_MARK (the reason), and vLLM starts on it with ``skip_tokenizer_init=False`` (``engine_args``).
Prompts stay token ids inside the tiny vocabulary.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

TOKENIZER_MARK = "enginecheck_tokenizer.txt"  # in a tiny checkpoint with the checker's tokenizer: why it has one
# Byte-level BPE's alphabet (GPT-2's bytes_to_unicode) of the printable ASCII bytes 0x20-0x7E: the tokens of ids 0-94.
BYTE_TOKENS: tuple[str, ...] = ("\u0120", *(chr(b) for b in range(0x21, 0x7F)))
# Whisper's special tokens vLLM's Whisper code spells (model_executor/models/whisper.py: the dummy and generation
# prompts), the end-of-text token first (WhisperTokenizer's unk, bos and eos).
WHISPER_TOKENS = ("<|endoftext|>", "<|startoftranscript|>", "<|en|>", "<|transcribe|>", "<|translate|>",
                  "<|notimestamps|>")


def _inkling_tokens(config: Mapping[str, Any]) -> list[str]:
    """vllm/renderers/inkling.py: InklingRenderer's ``_HfBackedTmlTokenizer`` looks up every token of
    SPECIAL_TOKEN_SPELLINGS in the vocabulary when the engine builds its renderer (the first spelling of each)."""
    from vllm.renderers.inkling_encoding import SPECIAL_TOKEN_SPELLINGS

    return [spellings[0] for spellings in SPECIAL_TOKEN_SPELLINGS.values()]


def _deepseek_vl2_tokens(config: Mapping[str, Any]) -> list[str]:
    """vllm/model_executor/models/deepseek_vl2.py: the model's ``__init__`` reads ``tokenizer.vocab[_IMAGE_TOKEN]``."""
    from vllm.model_executor.models.deepseek_vl2 import _IMAGE_TOKEN

    return [_IMAGE_TOKEN]


def _isaac_tokens(config: Mapping[str, Any]) -> list[str]:
    """vllm/model_executor/models/isaac.py: the model's ``__init__`` encodes ``config.vision_token``
    (``_resolve_vision_token_id``)."""
    return [str(config.get("vision_token", "<image>"))]


# vLLM's code that reads the tokenizer of these architectures even with skip_tokenizer_init: the special tokens it
# looks up. Inkling: the "inkling" tokenizer mode vLLM's ModelConfig picks for both architectures selects
# InklingRenderer (renderers/registry.py), which needs the tokenizer when the engine starts.
TOKENIZER_READERS: dict[str, Callable[[Mapping[str, Any]], list[str]]] = {
    "InklingForCausalLM": _inkling_tokens,
    "InklingForConditionalGeneration": _inkling_tokens,
    "DeepseekVLV2ForCausalLM": _deepseek_vl2_tokens,
    "IsaacForConditionalGeneration": _isaac_tokens,
}


def tokenizer_reason(architecture: str, config: Mapping[str, Any], model_cls: type | None,
                     language_model_only: bool) -> str | None:
    """Why vLLM, started on the tiny checkpoint of ``architecture`` (config.json ``config``, vLLM's ``model_cls``),
    needs its tokenizer; None where it does not (then the checker writes none)."""
    if architecture in TOKENIZER_READERS:
        where = " ".join(str(TOKENIZER_READERS[architecture].__doc__).split())
        return f"vLLM's code reads the tokenizer of {architecture} ({where})"
    factories = getattr(model_cls, "_processor_factory", None)
    processor = getattr(factories, "processor", None)
    if not language_model_only and getattr(processor, "requires_tokenizer", False):
        return (f"vLLM builds the multimodal processor {getattr(processor, '__name__', processor)} of "
                f"{architecture}, which requires a tokenizer (BaseMultiModalProcessor.requires_tokenizer)")
    return None


def special_tokens(architecture: str, config: Mapping[str, Any]) -> list[str]:
    """The special tokens vLLM's code looks up in the tokenizer of ``architecture`` (WHISPER_TOKENS for Whisper)."""
    reader = TOKENIZER_READERS.get(architecture)
    if reader is not None:
        return reader(config)
    return list(WHISPER_TOKENS) if config.get("model_type") == "whisper" else []


def tiny_vocab(specials: Sequence[str], vocab_size: int) -> dict[str, int]:
    """BYTE_TOKENS, then ``specials`` (without repeats), numbered from 0; ValueError where that exceeds
    ``vocab_size``."""
    tokens = [*BYTE_TOKENS, *dict.fromkeys(s for s in specials if s not in BYTE_TOKENS)]
    if len(tokens) > vocab_size:
        raise ValueError(f"the tiny tokenizer needs {len(tokens)} tokens and the tiny config's vocab_size is "
                         f"{vocab_size}")
    return {token: i for i, token in enumerate(tokens)}


def tiny_tokenizer(specials: Sequence[str], vocab_size: int) -> Any:
    """A ``tokenizers.Tokenizer``: byte-level BPE without merges over ``tiny_vocab``, ``specials`` special."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    tokenizer = Tokenizer(models.BPE(vocab=tiny_vocab(specials, vocab_size), merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in dict.fromkeys(specials)])
    return tokenizer


def write_tokenizer(path: Path, specials: Sequence[str], vocab_size: int) -> None:
    """Write ``tiny_tokenizer`` to ``path`` with transformers' PreTrainedTokenizerFast (tokenizer.json,
    tokenizer_config.json)."""
    from transformers import PreTrainedTokenizerFast

    PreTrainedTokenizerFast(tokenizer_object=tiny_tokenizer(specials, vocab_size),
                            extra_special_tokens=list(dict.fromkeys(specials))).save_pretrained(str(path))


def write_whisper_processor(path: Path, config: Mapping[str, Any]) -> None:
    """Write a WhisperProcessor to ``path`` with its own ``save_pretrained``: a WhisperTokenizer over ``tiny_vocab``
    of WHISPER_TOKENS and a WhisperFeatureExtractor of the tiny encoder's ``num_mel_bins``, whose 30 s chunk makes
    ``2 * max_source_positions`` frames (Whisper's conv stride halves them). The decoder then starts at the tiny
    tokenizer's ``<|startoftranscript|>`` (``decoder_start_token_id`` in config.json and generation_config.json, as
    on the hub), where the tiny config's names a token outside the tiny vocabulary (transformers' default 50257)."""
    from transformers import WhisperFeatureExtractor, WhisperProcessor, WhisperTokenizer

    frames = 2 * int(config["max_source_positions"])
    extractor = WhisperFeatureExtractor(feature_size=int(config["num_mel_bins"]), chunk_length=30,
                                        hop_length=30 * 16000 // frames, sampling_rate=16000)
    vocab = tiny_vocab(WHISPER_TOKENS, int(config["vocab_size"]))
    tokenizer = WhisperTokenizer(vocab=vocab, merges=[], extra_special_tokens=list(WHISPER_TOKENS[1:]))
    WhisperProcessor(feature_extractor=extractor, tokenizer=tokenizer).save_pretrained(str(path))
    for name in ("config.json", "generation_config.json"):
        written = path / name
        saved = json.loads(written.read_text()) if written.exists() else {}
        if int(saved.get("decoder_start_token_id") or 0) >= len(vocab):
            saved["decoder_start_token_id"] = vocab["<|startoftranscript|>"]
            written.write_text(json.dumps(saved, indent=2))


def write_tokenizer_if_needed(architecture: str, path: Path, model_cls: type | None) -> str | None:
    """Write the tiny tokenizer into the checkpoint at ``path`` (its config.json written) where vLLM needs one
    (``tokenizer_reason``), with TOKENIZER_MARK holding the reason; the reason, or None where none is written."""
    from pytest_enginecheck.targets.vllm.checkpoints import composite
    from pytest_enginecheck.targets.vllm.checkpoints.reading import vocab_size
    from pytest_enginecheck.targets.vllm.probe import probe

    config = json.loads((path / "config.json").read_text())
    language_model_only = bool(composite.engine_args(str(path)).get("language_model_only"))
    if model_cls is None and not language_model_only and probe().model_kinds.get(architecture) == "multimodal":
        model_cls = _vllm_class(architecture)  # the class its multimodal processor is registered to
    reason = tokenizer_reason(architecture, config, model_cls, language_model_only)
    if reason is None:
        return None
    if config.get("model_type") == "whisper":
        write_whisper_processor(path, config)
    else:
        write_tokenizer(path, special_tokens(architecture, config), vocab_size(str(path)))
    (path / TOKENIZER_MARK).write_text(reason + "\n")
    return reason


def _vllm_class(architecture: str) -> type | None:
    """vLLM's registered class of ``architecture`` (None where it cannot be imported)."""
    from pytest_enginecheck.targets.vllm.describe import registry

    entry = next((e for e in registry.list_architectures() if e.architecture == architecture), None)
    return registry.import_model_class(entry).model_cls if entry is not None else None


def engine_args(ckpt: str) -> dict[str, Any]:
    """``skip_tokenizer_init=False`` for a checkpoint with the checker's tokenizer (TOKENIZER_MARK), else nothing."""
    return {"skip_tokenizer_init": False} if (Path(ckpt) / TOKENIZER_MARK).exists() else {}
