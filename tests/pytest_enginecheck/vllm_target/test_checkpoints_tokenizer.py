"""The checker's tiny tokenizer (targets/vllm/checkpoints/tokenizer.py) without vLLM: transformers reads what it
writes, the vocabulary fits the tiny config, the same bytes every time, and only the architectures vLLM reads one of
get one."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from pytest_enginecheck.targets.vllm.checkpoints import tokenizer

pytest.importorskip("tokenizers")
transformers = pytest.importorskip("transformers")

SPECIALS = ["<|user|>", "<image>"]
WHISPER_CONFIG = {"model_type": "whisper", "max_source_positions": 1500, "num_mel_bins": 80, "vocab_size": 256}


def _files(path: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(path.iterdir())}


def test_the_tokenizer_round_trips_through_autotokenizer_inside_the_tiny_vocab(tmp_path: Path) -> None:
    tokenizer.write_tokenizer(tmp_path, SPECIALS, 256)
    tok = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    ids = tok.encode("Hello world <image>!", add_special_tokens=False)
    assert tok.decode(ids) == "Hello world <image>!"
    assert ids[-2] == tok.convert_tokens_to_ids("<image>") and ids[-2] > max(ids[:-2]) + 1
    assert len(tok) == len(tokenizer.BYTE_TOKENS) + len(SPECIALS) <= 256
    assert max(tok.get_vocab().values()) < 256


def test_the_tokenizer_is_the_same_bytes_every_time(tmp_path: Path) -> None:
    for run in ("a", "b"):
        (tmp_path / run).mkdir()
        tokenizer.write_tokenizer(tmp_path / run, SPECIALS, 256)
    assert _files(tmp_path / "a") == _files(tmp_path / "b")
    assert set(_files(tmp_path / "a")) == {"tokenizer.json", "tokenizer_config.json"}


def test_a_vocab_larger_than_the_tiny_config_is_refused() -> None:
    with pytest.raises(ValueError, match="needs 97 tokens and the tiny config's vocab_size is 96"):
        tokenizer.tiny_vocab(SPECIALS, 96)


def test_whispers_processor_is_written_by_its_own_classes_and_sized_to_the_tiny_encoder(tmp_path: Path) -> None:
    import json

    for run in ("a", "b"):
        (tmp_path / run).mkdir()
        (tmp_path / run / "config.json").write_text(json.dumps({**WHISPER_CONFIG, "decoder_start_token_id": 50257}))
        tokenizer.write_whisper_processor(tmp_path / run, WHISPER_CONFIG)
    assert _files(tmp_path / "a") == _files(tmp_path / "b")
    processor = transformers.AutoProcessor.from_pretrained(str(tmp_path / "a"))
    assert type(processor).__name__ == "WhisperProcessor"
    assert type(processor.tokenizer).__name__ == "WhisperTokenizer"
    extractor = processor.feature_extractor
    assert extractor.feature_size == 80 and extractor.nb_max_frames == 2 * 1500
    ids = processor.tokenizer.encode("<|startoftranscript|>hi", add_special_tokens=False)
    assert processor.tokenizer.decode(ids) == "<|startoftranscript|>hi" and max(ids) < 256
    # the decoder starts at the tiny tokenizer's <|startoftranscript|>, not at the full vocabulary's id
    start = json.loads((tmp_path / "a" / "config.json").read_text())["decoder_start_token_id"]
    assert start == ids[0] == processor.tokenizer.convert_tokens_to_ids("<|startoftranscript|>")


class _Processor:
    requires_tokenizer = True


class _Factories:
    processor = _Processor


class _MultimodalModel:
    _processor_factory = _Factories


@pytest.mark.parametrize(("architecture", "model_cls", "language_model_only", "needs"), [
    ("LlamaForCausalLM", None, False, False),
    ("InklingForCausalLM", None, False, True),  # vLLM's InklingRenderer
    ("LlavaForConditionalGeneration", _MultimodalModel, True, False),  # no processor is built
    ("WhisperForConditionalGeneration", _MultimodalModel, False, True),  # the processor requires_tokenizer
])
def test_only_architectures_vllm_reads_a_tokenizer_of_get_one(architecture: str, model_cls: Any,
                                                              language_model_only: bool, needs: bool) -> None:
    reason = tokenizer.tokenizer_reason(architecture, {}, model_cls, language_model_only)
    assert (reason is not None) == needs, reason


def test_vllm_starts_with_the_tokenizer_only_where_the_checker_wrote_one(tmp_path: Path) -> None:
    assert tokenizer.engine_args(str(tmp_path)) == {}
    (tmp_path / tokenizer.TOKENIZER_MARK).write_text("why\n")
    assert tokenizer.engine_args(str(tmp_path)) == {"skip_tokenizer_init": False}
