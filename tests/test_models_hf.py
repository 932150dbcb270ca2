"""Every bundled architecture equals Hugging Face transformers' implementation of it.

transformers is the reference no one here wrote: on the same tiny random checkpoint (float32), the
engine's greedy tokens equal transformers' ``generate`` and the engine model's logits for a whole
prompt equal transformers' logits. Llava is fed images, and a different image must change its output.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.conftest import ARCHITECTURES

MAX_TOKENS = 8
TEXT_PROMPTS = [[1, 5, 9], [1, 20, 30, 40, 50, 60, 70], [1, *range(100, 113)]]
LLAVA = "LlavaForConditionalGeneration"


@dataclass
class ModelPair:
    """One architecture's checkpoint, loaded by transformers and by engine_ref's loader."""

    checkpoint: Path
    hf_model: Any
    loading_info: dict[str, Any]
    our_model: torch.nn.Module
    config: Any  # engine_ref's EngineConfig


@pytest.fixture(scope="module")
def model_pair(tiny_checkpoint: Callable[..., Path]) -> Callable[[str], ModelPair]:
    """``model_pair(arch)``: both models of an architecture, loaded once per module."""
    import transformers

    from engine_ref.engine.arg_utils import EngineArgs
    from engine_ref.model_executor.model_loader.loaders import get_model_loader

    pairs: dict[str, ModelPair] = {}

    def get(arch: str) -> ModelPair:
        if arch not in pairs:
            checkpoint = tiny_checkpoint(arch)
            hf_model, info = getattr(transformers, arch).from_pretrained(
                checkpoint, output_loading_info=True, dtype=torch.float32)
            config = EngineArgs(model=str(checkpoint)).create_engine_config()
            ours = get_model_loader(config.load_config).load_model(config, torch.device("cpu"))
            pairs[arch] = ModelPair(checkpoint, hf_model.eval(), info, ours, config)
        return pairs[arch]

    return get


def image_prompts(pair: ModelPair) -> tuple[list[list[int]], int]:
    """Llava prompts of different lengths, each holding one image's placeholder tokens."""
    hf_config = pair.config.model_config.hf_config
    vision = hf_config.vision_config
    assert hf_config.vision_feature_select_strategy == "default"
    tokens_per_image = (vision.image_size // vision.patch_size) ** 2
    image = [hf_config.image_token_index] * tokens_per_image
    return [[1, 5, *image, 9], [1, *image, 20, 30, 40, 50, 60, 70], [1, 3, 4, 5, 6, *image, *range(100, 110)]], \
        tokens_per_image


def images(pair: ModelPair, seed: int, count: int) -> list[torch.Tensor]:
    vision = pair.config.model_config.hf_config.vision_config
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(vision.num_channels, vision.image_size, vision.image_size, generator=generator)
            for _ in range(count)]


def our_generate(pair: ModelPair, prompts: list[list[int]], pixels: list[torch.Tensor] | None = None
                 ) -> list[list[int]]:
    from engine_ref import LLM

    with LLM(str(pair.checkpoint), max_model_len=128, max_num_batched_tokens=128) as llm:
        return llm.generate(prompt_token_ids=prompts, max_tokens=MAX_TOKENS, images=pixels, ignore_eos=True)


@torch.inference_mode()
def hf_generate(pair: ModelPair, prompts: list[list[int]], pixels: list[torch.Tensor] | None = None
                ) -> list[list[int]]:
    outputs = []
    for i, prompt in enumerate(prompts):
        input_ids = torch.tensor([prompt])
        extra = {} if pixels is None else {"pixel_values": pixels[i][None]}
        out = pair.hf_model.generate(input_ids, attention_mask=torch.ones_like(input_ids), do_sample=False,
                                     max_new_tokens=MAX_TOKENS, min_new_tokens=MAX_TOKENS, **extra)
        outputs.append(out[0, len(prompt):].tolist())
    return outputs


@torch.inference_mode()
def our_logits(pair: ModelPair, prompt: list[int], pixel_values: torch.Tensor | None = None) -> torch.Tensor:
    """Logits for every position of ``prompt``, from the engine's model run directly (no KV cache)."""
    from engine_ref.model_executor.forward_context import AttentionMetadata, set_forward_context

    n = len(prompt)
    extra = {} if pixel_values is None else {"pixel_values": pixel_values}
    with set_forward_context(AttentionMetadata(query_start_loc=[0, n], seq_lens=[n])):
        hidden_states = pair.our_model(torch.tensor(prompt), torch.arange(n), **extra)
    return pair.our_model.compute_logits(hidden_states)


@torch.inference_mode()
def hf_logits(pair: ModelPair, prompt: list[int], pixel_values: torch.Tensor | None = None) -> torch.Tensor:
    extra = {} if pixel_values is None else {"pixel_values": pixel_values}
    return pair.hf_model(torch.tensor([prompt]), **extra).logits[0]


def assert_same_tokens(ours: list[list[int]], theirs: list[list[int]], eos: int) -> None:
    assert all(len(tokens) == MAX_TOKENS for tokens in ours)
    assert ours == theirs, (
        "greedy tokens differ from transformers'"
        + (f" (our output holds EOS {eos}, which transformers' min_new_tokens suppresses; pick other prompts)"
           if any(eos in tokens for tokens in ours) else "")
    )


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_transformers_loads_our_checkpoint_completely(arch: str, model_pair: Callable[[str], ModelPair]) -> None:
    pair = model_pair(arch)
    info = pair.loading_info
    assert not info["unexpected_keys"]
    assert not info.get("mismatched_keys")
    assert not info.get("error_msgs")
    missing = set(info["missing_keys"])
    if arch == LLAVA:
        # Llava reads the vision tower's second-to-last layer: its last layer and post_layernorm
        # are unused, so the engine neither loads nor writes them.
        last = pair.config.model_config.hf_config.vision_config.num_hidden_layers - 1
        unused = re.compile(rf"vision_tower\.(vision_model\.)?(encoder\.layers\.{last}\.|post_layernorm\.)")
        assert missing and all(unused.search(key) for key in missing), sorted(missing)
    else:
        assert not missing


@pytest.mark.parametrize("arch", [a for a in ARCHITECTURES if a != LLAVA])
def test_greedy_tokens_equal_transformers(arch: str, model_pair: Callable[[str], ModelPair]) -> None:
    pair = model_pair(arch)
    ours = our_generate(pair, TEXT_PROMPTS)
    assert_same_tokens(ours, hf_generate(pair, TEXT_PROMPTS), pair.config.model_config.hf_text_config.eos_token_id)


@pytest.mark.parametrize("arch", [a for a in ARCHITECTURES if a != LLAVA])
def test_logits_equal_transformers(arch: str, model_pair: Callable[[str], ModelPair]) -> None:
    pair = model_pair(arch)
    for prompt in TEXT_PROMPTS:
        ours, theirs = our_logits(pair, prompt), hf_logits(pair, prompt)
        assert ours.shape == theirs.shape == (len(prompt), pair.config.model_config.hf_text_config.vocab_size)
        torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=0)


def test_llava_greedy_tokens_with_images_equal_transformers(model_pair: Callable[[str], ModelPair]) -> None:
    pair = model_pair(LLAVA)
    prompts, tokens_per_image = image_prompts(pair)
    assert tokens_per_image == pair.our_model.tokens_per_image
    pixels = images(pair, seed=0, count=len(prompts))
    ours = our_generate(pair, prompts, pixels)
    assert_same_tokens(ours, hf_generate(pair, prompts, pixels), pair.config.model_config.hf_text_config.eos_token_id)
    # The image is really used: other images, other tokens.
    assert our_generate(pair, prompts, images(pair, seed=1, count=len(prompts))) != ours


def test_llava_logits_with_images_equal_transformers(model_pair: Callable[[str], ModelPair]) -> None:
    pair = model_pair(LLAVA)
    prompts, _ = image_prompts(pair)
    first, second = images(pair, seed=0, count=2)
    for prompt in prompts:
        ours = our_logits(pair, prompt, first[None])
        torch.testing.assert_close(ours, hf_logits(pair, prompt, first[None]), atol=1e-4, rtol=0)
        other = our_logits(pair, prompt, second[None])
        torch.testing.assert_close(other, hf_logits(pair, prompt, second[None]), atol=1e-4, rtol=0)
        assert (ours - other).abs().max() > 1e-2  # the image changes the logits
