"""Multimodal architectures whose config class is vLLM's own (targets/vllm/vllm_multimodal.py): the composite config
shrunk part by part and written in the hub's layout, the weights written from vLLM's side, vLLM's engine on them
(``load[tp=1]``); and the encoder-decoder head rule of composite.py (Whisper)."""

from __future__ import annotations

from typing import Any

from tests.vllm.load_check import load_tp1

# UltravoxConfig (vLLM's): a Llama text decoder held as ``wrapped_model_config``, read from the hub's ``text_config``,
# and a Whisper audio encoder; the cheapest of the multimodal checkpoints written from vLLM's side.
ULTRAVOX = "UltravoxModel"


def _config(architecture: str) -> Any:
    import json

    from pytest_enginecheck.targets.vllm.checkpoints.multimodal import tiny_multimodal_config
    from pytest_enginecheck.targets.vllm.checkpoints.shrink import NoTinyCheckpoint
    from pytest_enginecheck.targets.vllm.checkpoints.vllm_build import vllm_class

    try:
        return json.loads(tiny_multimodal_config(architecture, vllm_class(architecture)).to_json_string())
    except NoTinyCheckpoint as e:
        return str(e)


def test_a_vllm_composite_config_is_shrunk_part_by_part_in_the_hubs_layout(in_child: Any) -> None:
    saved = in_child(_config, ULTRAVOX)
    assert isinstance(saved, dict), saved
    # the hub's key (UltravoxConfig reads text_config, holds wrapped_model_config), the text decoder tiny
    assert "wrapped_model_config" not in saved
    text, audio = saved["text_config"], saved["audio_config"]
    assert (text["hidden_size"], text["num_hidden_layers"], text["vocab_size"]) == (64, 2, 256)
    assert saved["vocab_size"] == text["vocab_size"]  # read at the top level by vLLM's ultravox.py
    # the Whisper encoder: every head count divides d_model (the decoder's too)
    assert audio["d_model"] == 64 and audio["encoder_layers"] == 2
    assert audio["encoder_attention_heads"] == audio["decoder_attention_heads"] == 2
    assert saved["hidden_size"] == 64  # the projector's output meets the text decoder


def test_a_multimodal_class_whose_config_is_one_part_says_so(in_child: Any) -> None:
    message = in_child(_config, "Phi3VForCausalLM")  # its module imports CLIPVisionConfig: its own config is remote
    assert isinstance(message, str), message
    # the config class its module imports is one part, and its own config comes from remote code
    assert "clip_vision_model" in message and "remote code" in message


def test_load_tp1_runs_vllms_engine_on_a_multimodal_checkpoint_written_from_vllms_side(in_child: Any,
                                                                                        tmp_path: Any) -> None:
    import json

    from safetensors import safe_open

    from pytest_enginecheck.targets.vllm.checkpoints.tiny import CHECKPOINTS_DIR

    detail = in_child(load_tp1, str(tmp_path), ULTRAVOX)
    assert isinstance(detail, dict), detail
    assert detail["tensor_parallel_size"] == 1 and [len(t) for t in detail["tokens"]] == [6, 6, 6]
    path = tmp_path / CHECKPOINTS_DIR / ULTRAVOX
    config = json.loads((path / "config.json").read_text())
    assert config["architectures"] == [ULTRAVOX] and config["model_type"] == "ultravox"
    # language_model_only: vLLM builds no audio tower, so only the text model's tensors are written (and proven)
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        assert {name.split(".")[0] for name in f.keys()} == {"language_model"}  # noqa: SIM118


def _written(workdir: str, architecture: str) -> tuple[dict[str, Any], dict[str, tuple[int, ...]], dict[str, Any]]:
    """The tiny checkpoint of ``architecture`` (made and its round trip proven): its config.json, its tensors'
    shapes, and vLLM's engine arguments for it."""
    import json
    import os
    from pathlib import Path

    from safetensors import safe_open

    from pytest_enginecheck.targets.vllm.checkpoints.args import checkpoint_args
    from pytest_enginecheck.targets.vllm.checkpoints.tiny import make_tiny_checkpoint
    from pytest_enginecheck.targets.vllm.checkpoints.vllm_build import vllm_class

    os.environ["VLLM_PLUGINS"] = "clean"  # not the test site's raising plugins (tests/vllm/plugin_dist.py)
    path = make_tiny_checkpoint(architecture, Path(workdir) / architecture, vllm_class(architecture))
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        shapes = {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}  # noqa: SIM118
    return json.loads((path / "config.json").read_text()), shapes, checkpoint_args(str(path))


def test_a_packed_layer_its_loader_takes_fused_is_written_whole(in_child: Any, tmp_path: Any) -> None:
    # Moondream3's load_weights maps the hub's fused ``attn.qkv`` onto qkv_proj and has no q/k/v shard mapping
    config, shapes, args = in_child(_written, str(tmp_path), "Moondream3ForCausalLM")
    assert shapes["text.blocks.1.attn.qkv_proj.weight"] == (3 * 64, 64)
    assert not [name for name in shapes if ".q_proj." in name]
    # its text and vision configs are config.text / config.vision: vLLM lists it multimodal, so text-only
    assert "text_config" not in config and args == {"language_model_only": True}
    assert not [name for name in shapes if name.startswith("vision.")]  # the tower is not built, so not written


def test_a_text_decoder_under_a_name_get_text_config_misses_is_shrunk(in_child: Any, tmp_path: Any) -> None:
    # BagelConfig holds its Qwen2 decoder as ``llm_config`` beside a SigLIP ``vit_config`` (TEXT_SUB_CONFIGS)
    config, shapes, args = in_child(_written, str(tmp_path), "BagelForConditionalGeneration")
    text, vision = config["llm_config"], config["vit_config"]
    assert (text["hidden_size"], text["num_hidden_layers"], text["vocab_size"]) == (64, 2, 256)
    assert (vision["hidden_size"], vision["num_hidden_layers"]) == (64, 2)
    assert vision["image_size"] == 4 * vision["patch_size"]
    assert args == {"language_model_only": True}
    assert shapes["language_model.model.embed_tokens.weight"] == (256, 64)
    assert {name.split(".")[0] for name in shapes} == {"language_model"}  # no tower built, none written


def test_sub_configs_only_the_hub_fills_in_are_given_tiny_and_written_under_the_hubs_keys(in_child: Any,
                                                                                          tmp_path: Any) -> None:
    # OvisConfig's defaults hold no sub-config; HUB_SUB_CONFIGS gives Ovis2's (Qwen2 + AIMv2 visual tokenizer), and
    # its constructor reads the decoder as llm_config (and pops model_type from it: the written dicts keep theirs)
    config, shapes, args = in_child(_written, str(tmp_path), "Ovis")
    text, visual = config["llm_config"], config["visual_tokenizer_config"]
    assert "text_config" not in config and text["model_type"] == "qwen2"
    assert (text["hidden_size"], text["num_hidden_layers"], text["vocab_size"]) == (64, 2, 256)
    assert visual["model_type"] == "aimv2_visual_tokenizer" and visual["vocab_size"] == 256
    assert (visual["backbone_config"]["hidden_size"], visual["backbone_config"]["num_hidden_layers"]) == (64, 2)
    assert config["hidden_size"] == text["hidden_size"] and args == {"language_model_only": True}
    assert {name.split(".")[0] for name in shapes} == {"llm"}  # the visual tokenizer is a tower: not built


def test_a_text_decoders_config_gets_its_encoders_as_the_hubs_dicts(in_child: Any, tmp_path: Any) -> None:
    # GLM-4V: ChatGLMConfig is the text decoder; its EVA2-CLIP encoder is a plain vision_config dict (ENCODER_FIELDS)
    config, shapes, args = in_child(_written, str(tmp_path), "GLM4VForCausalLM")
    assert config["model_type"] == "chatglm" and (config["hidden_size"], config["num_layers"]) == (64, 2)
    vision = config["vision_config"]
    assert (vision["hidden_size"], vision["num_hidden_layers"]) == (64, 2)
    assert vision["num_positions"] == (vision["image_size"] // vision["patch_size"]) ** 2 + 1
    assert max(config["boi_token_id"], config["eoi_token_id"]) < config["vocab_size"]
    assert args == {"language_model_only": True}
    assert shapes["transformer.embedding.weight"] == (256, 64)
    assert not [name for name in shapes if ".vision." in name]  # no tower built, none written
    # FireRedASR2: a Qwen2Config beside a Conformer audio_encoder_conf (whose positional encoding reads a tensor's
    # value as it is built: not on the meta device, so its size is counted on the CPU)
    config, shapes, args = in_child(_written, str(tmp_path), "FireRedASR2ForConditionalGeneration")
    assert config["model_type"] == "qwen2" and config["audio_encoder_conf"]["d_model"] == 64
    assert args == {"language_model_only": True}
    assert {name.split(".")[1] for name in shapes} == {"decoder"}  # the Conformer and its adapter are towers


def _whisper() -> Any:
    from pytest_enginecheck.targets.vllm.checkpoints.from_transformers import tiny_config

    return tiny_config("WhisperForConditionalGeneration").to_dict()


def test_an_encoder_decoders_decoder_heads_are_shrunk_with_its_width(in_child: Any) -> None:
    config = in_child(_whisper)
    assert config["d_model"] == 64
    assert (config["encoder_attention_heads"], config["decoder_attention_heads"]) == (2, 2)
    assert (config["encoder_layers"], config["decoder_layers"], config["decoder_ffn_dim"]) == (2, 2, 128)


def _sub_configs(architecture: str) -> tuple[list[str], list[str]]:
    from pytest_enginecheck.targets.vllm.checkpoints import composite
    from pytest_enginecheck.targets.vllm.checkpoints.from_transformers import hf_class

    defaults = hf_class(architecture).config_class()
    return sorted(composite._sub_configs(defaults)), sorted(type(defaults).sub_configs)


def test_sub_configs_found_by_attribute_are_the_declared_ones_of_a_transformers_composite(in_child: Any) -> None:
    found, declared = in_child(_sub_configs, "PaliGemmaForConditionalGeneration")
    assert found == declared == ["text_config", "vision_config"]


WHISPER_TRACEBACK = '''Traceback (most recent call last):
  File "/venv/lib/python3.11/site-packages/vllm/multimodal/registry.py", line 76, in build_processor
    return self.processor(info, dummy_inputs_builder)
  File "/venv/lib/python3.11/site-packages/vllm/multimodal/processing/processor.py", line 1048, in __init__
    raise ValueError(
ValueError: WhisperMultiModalProcessor requires a tokenizer and cannot be initialized when `skip_tokenizer_init=True`.
'''


def test_a_multimodal_processor_that_needs_the_tokenizer_is_the_checkers_limit() -> None:
    from pytest_enginecheck.targets.vllm.failures import EngineFailure
    from pytest_enginecheck.targets.vllm.limits import checker_limit

    exception = ("ValueError: WhisperMultiModalProcessor requires a tokenizer and cannot be initialized when "
                 "`skip_tokenizer_init=True`. Disable `--skip-tokenizer-init`.")
    reason = checker_limit(EngineFailure("startup", 0, exception, "", WHISPER_TRACEBACK))
    assert reason == ("vLLM's WhisperMultiModalProcessor needs the checkpoint's tokenizer, and the checker's tiny "
                      "checkpoint has none (vLLM starts on it with skip_tokenizer_init)")
    # the same words raised by a model's own code are the model's failure
    elsewhere = WHISPER_TRACEBACK.replace("vllm/multimodal/processing/processor.py", "my_model/processing.py")
    assert checker_limit(EngineFailure("startup", 0, exception, "", elsewhere)) is None
