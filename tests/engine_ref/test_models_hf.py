"""Every bundled architecture equals Hugging Face transformers' implementation of it.

transformers is the reference no one here wrote: on the same tiny random checkpoint (float32), the
engine's greedy tokens equal transformers' ``generate`` and the engine model's logits for a whole
prompt equal transformers' logits. Llava is fed images, and a different image must change its output.
Both ways: engine_ref's own checkpoints (``make_checkpoint``) load in transformers, and checkpoints
transformers writes (``save_pretrained``, its config.json spellings) load in engine_ref. The
config.json spellings engine_ref accepts (aliases, rope defaults and layouts) equal transformers'.
"""

from __future__ import annotations

import importlib
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.helpers import ARCHITECTURES

MAX_TOKENS = 8
TEXT_PROMPTS = [[1, 5, 9], [1, 20, 30, 40, 50, 60, 70], [1, *range(100, 113)]]
LLAVA = "LlavaForConditionalGeneration"
# Where a checkpoint comes from: engine_ref's generator, or transformers' save_pretrained.
SOURCES = ["make_checkpoint", "save_pretrained"]


@dataclass
class ModelPair:
    """One architecture's checkpoint, loaded by transformers and by engine_ref's loader."""

    checkpoint: Path
    hf_model: Any
    loading_info: dict[str, Any]
    our_model: torch.nn.Module
    config: Any  # engine_ref's EngineConfig


def save_pretrained_checkpoint(arch: str, path: Path) -> Path:
    """A tiny checkpoint written by transformers: the example config, random init (fixed seed), float32."""
    import transformers

    from engine_ref.model_executor.model_loader.checkpoint import example_config

    config = example_config(arch)
    hf_config = transformers.AutoConfig.for_model(**config)
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = getattr(transformers, arch)(hf_config)
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def model_pair(tiny_checkpoint: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory
               ) -> Callable[..., ModelPair]:
    """``model_pair(arch, source)``: both models of an architecture's checkpoint, loaded once per module."""
    import transformers

    from engine_ref.engine.arg_utils import EngineArgs
    from engine_ref.model_executor.model_loader.loaders import get_model_loader

    pairs: dict[tuple[str, str], ModelPair] = {}

    def get(arch: str, source: str = "make_checkpoint") -> ModelPair:
        if (arch, source) not in pairs:
            if source == "make_checkpoint":
                checkpoint = tiny_checkpoint(arch)
            else:
                checkpoint = save_pretrained_checkpoint(arch, tmp_path_factory.mktemp(f"hf-{arch}"))
            hf_model, info = getattr(transformers, arch).from_pretrained(
                checkpoint, output_loading_info=True, dtype=torch.float32)
            config = EngineArgs(model=str(checkpoint)).create_engine_config()
            ours = get_model_loader(config.load_config).load_model(config, torch.device("cpu"))
            pairs[arch, source] = ModelPair(checkpoint, hf_model.eval(), info, ours, config)
        return pairs[arch, source]

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
def test_transformers_loads_our_checkpoint_completely(arch: str, model_pair: Callable[..., ModelPair]) -> None:
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


@pytest.mark.parametrize("source", SOURCES)
@pytest.mark.parametrize("arch", [a for a in ARCHITECTURES if a != LLAVA])
def test_greedy_tokens_equal_transformers(arch: str, source: str, model_pair: Callable[..., ModelPair]) -> None:
    pair = model_pair(arch, source)
    ours = our_generate(pair, TEXT_PROMPTS)
    assert_same_tokens(ours, hf_generate(pair, TEXT_PROMPTS), pair.config.model_config.hf_text_config.eos_token_id)


@pytest.mark.parametrize("source", SOURCES)
@pytest.mark.parametrize("arch", [a for a in ARCHITECTURES if a != LLAVA])
def test_logits_equal_transformers(arch: str, source: str, model_pair: Callable[..., ModelPair]) -> None:
    pair = model_pair(arch, source)
    for prompt in TEXT_PROMPTS:
        ours, theirs = our_logits(pair, prompt), hf_logits(pair, prompt)
        assert ours.shape == theirs.shape == (len(prompt), pair.config.model_config.hf_text_config.vocab_size)
        torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=0)


@pytest.mark.parametrize("source", SOURCES)
def test_llava_greedy_tokens_with_images_equal_transformers(source: str, model_pair: Callable[..., ModelPair]
                                                            ) -> None:
    pair = model_pair(LLAVA, source)
    prompts, tokens_per_image = image_prompts(pair)
    assert tokens_per_image == pair.our_model.tokens_per_image
    pixels = images(pair, seed=0, count=len(prompts))
    ours = our_generate(pair, prompts, pixels)
    assert_same_tokens(ours, hf_generate(pair, prompts, pixels), pair.config.model_config.hf_text_config.eos_token_id)
    # The image is really used: other images, other tokens.
    assert our_generate(pair, prompts, images(pair, seed=1, count=len(prompts))) != ours


@pytest.mark.parametrize("source", SOURCES)
def test_llava_logits_with_images_equal_transformers(source: str, model_pair: Callable[..., ModelPair]) -> None:
    pair = model_pair(LLAVA, source)
    prompts, _ = image_prompts(pair)
    first, second = images(pair, seed=0, count=2)
    for prompt in prompts:
        ours = our_logits(pair, prompt, first[None])
        torch.testing.assert_close(ours, hf_logits(pair, prompt, first[None]), atol=1e-4, rtol=0)
        other = our_logits(pair, prompt, second[None])
        torch.testing.assert_close(other, hf_logits(pair, prompt, second[None]), atol=1e-4, rtol=0)
        assert (ours - other).abs().max() > 1e-2  # the image changes the logits


def test_save_pretrained_writes_the_spellings_engine_ref_must_read(model_pair: Callable[..., ModelPair]) -> None:
    """The save_pretrained checkpoints above really use transformers 5's spellings, not the Hub's."""
    import json

    checkpoint = model_pair("Qwen3MoeForCausalLM", "save_pretrained").checkpoint
    qwen3_moe = json.loads((checkpoint / "config.json").read_text())
    assert "num_local_experts" in qwen3_moe and "num_experts" not in qwen3_moe
    assert "rope_parameters" in qwen3_moe and "rope_theta" not in qwen3_moe


def bundled_configs() -> list[tuple[str, dict[str, Any]]]:
    """(architecture, config) of every bundled example config and its text and vision configs."""
    from engine_ref.model_executor.model_loader.checkpoint import example_config

    configs = []
    for arch in ARCHITECTURES:
        config = example_config(arch)
        configs += [(arch, config)] + [(arch, config[key]) for key in ("text_config", "vision_config") if key in config]
    return configs


@pytest.mark.parametrize("arch, config", bundled_configs(), ids=lambda v: v if isinstance(v, str) else v["model_type"])
def test_config_aliases_and_rope_defaults_equal_transformers(arch: str, config: dict[str, Any]) -> None:
    import transformers

    from engine_ref.config.hf_config import HF_ATTRIBUTE_MAPS
    from engine_ref.model_executor.layers.rotary_embedding import DEFAULT_ROPE_THETA, DEFAULT_ROPE_THETAS

    config_cls = transformers.CONFIG_MAPPING[config["model_type"]]
    assert HF_ATTRIBUTE_MAPS.get(config["model_type"], {}) == config_cls.attribute_map
    if "rope_theta" in config:  # a text config
        assert DEFAULT_ROPE_THETAS.get(config["model_type"], DEFAULT_ROPE_THETA) == config_cls.default_theta


def test_every_alias_reads_under_both_names() -> None:
    from engine_ref.config.hf_config import HF_ATTRIBUTE_MAPS, HFConfig

    for model_type, aliases in HF_ATTRIBUTE_MAPS.items():
        for alias, name in aliases.items():
            for written in (alias, name):
                config = HFConfig({"model_type": model_type, written: 7})
                assert dict(config) == {"model_type": model_type, name: 7}  # stored under transformers' name
                assert config[alias] == config[name] == getattr(config, alias) == config.get(alias) == 7
                assert alias in config and name in config


def rope_layouts(config: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """One text config in every rotary layout config.json files use."""
    base = {k: v for k, v in config.items() if k not in ("rope_theta", "rope_scaling", "rope_parameters")}
    llama3 = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}
    return {
        "rope_theta": {**base, "rope_theta": 500000.0},
        "none": base,
        "rope_parameters": {**base, "rope_parameters": {"rope_type": "default", "rope_theta": 250000.0}},
        "rope_scaling-llama3": {**base, "rope_theta": 500000.0, "rope_scaling": {
            "type": "llama3", **llama3, "original_max_position_embeddings": 64}},
        "rope_parameters-llama3": {**base, "rope_parameters": {
            "rope_type": "llama3", "rope_theta": 500000.0, **llama3}},
        "both": {**base, "rope_theta": 1000.0, "rope_parameters": {"rope_type": "default", "rope_theta": 2000.0}},
    }


@pytest.mark.parametrize("arch, config", [c for c in bundled_configs() if "rope_theta" in c[1]],
                         ids=lambda v: v if isinstance(v, str) else v["model_type"])
def test_rope_parameters_and_tables_equal_transformers(arch: str, config: dict[str, Any]) -> None:
    """Each layout standardises to transformers' ``rope_parameters`` and gives its inverse frequencies."""
    import transformers

    from engine_ref.config import HFConfig
    from engine_ref.model_executor.layers.rotary_embedding import get_rope, get_rope_parameters

    model_type = config["model_type"]
    modeling = importlib.import_module(f"transformers.models.{model_type}.modeling_{model_type}")
    [rotary_cls] = [v for k, v in vars(modeling).items() if k.endswith("RotaryEmbedding")]
    for layout, written in rope_layouts(config).items():
        theirs = transformers.CONFIG_MAPPING[model_type](**written)
        ours = HFConfig(written)
        assert get_rope_parameters(ours) == theirs.rope_parameters, layout
        head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
        torch.testing.assert_close(get_rope(head_dim, ours).inv_freq, rotary_cls(theirs).inv_freq, rtol=0, atol=0,
                                   msg=layout)


def test_rotary_table_is_one_instance_per_configuration(model_pair: Callable[..., ModelPair]) -> None:
    from engine_ref.config import HFConfig
    from engine_ref.model_executor.layers.rotary_embedding import get_rope, shared_rope_scope

    model = model_pair("LlamaForCausalLM").our_model
    ropes = {id(layer.self_attn.rotary_emb) for layer in model.model.layers}
    assert len(model.model.layers) > 1 and len(ropes) == 1
    assert [name for name, _ in model.named_buffers()] == ["model.layers.0.self_attn.rotary_emb.inv_freq"]
    config = model.config
    with shared_rope_scope():
        assert get_rope(16, config) is get_rope(16, config)
        assert get_rope(16, HFConfig({**config, "rope_theta": 1.0})) is not get_rope(16, config)
        assert get_rope(8, config) is not get_rope(16, config)
    # Each build has its own: another model (or one on the meta device) shares nothing with this one.
    assert get_rope(16, config) is not get_rope(16, config)
    assert model_pair("LlamaForCausalLM", "save_pretrained").our_model.model.layers[0].self_attn.rotary_emb \
        is not model.model.layers[0].self_attn.rotary_emb


@pytest.mark.parametrize("config, needles", [
    ({"rope_scaling": {"type": "yarn", "factor": 4.0}}, ("'yarn'", "default, llama3")),
    ({"rope_parameters": {"rope_type": "llama3", "factor": 8.0}, "max_position_embeddings": 512},
     ("'llama3' needs", "low_freq_factor", "high_freq_factor")),
    ({"rope_theta": 1e4, "partial_rotary_factor": 0.5}, ("partial_rotary_factor=0.5", "1.0")),
    ({"rope_parameters": {"full_attention": {"rope_theta": 1e4}, "sliding_attention": {"rope_theta": 1e3}}},
     ("per layer type", "full_attention", "sliding_attention")),
], ids=["unsupported-type", "llama3-incomplete", "partial-rotary", "per-layer-type"])
def test_rope_settings_engine_ref_cannot_honour_are_refused(config: dict[str, Any], needles: tuple[str, ...]) -> None:
    from engine_ref.config import HFConfig
    from engine_ref.errors import ConfigError
    from engine_ref.model_executor.layers.rotary_embedding import get_rope_parameters

    with pytest.raises(ConfigError) as info:
        get_rope_parameters(HFConfig({"model_type": "llama", **config}))
    assert all(needle in str(info.value) for needle in needles), str(info.value)
