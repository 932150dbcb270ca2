"""Tiny configs of vLLM's multimodal architectures that transformers has no model class for.

The config class is the one vLLM parses the checkpoint with (``vllm_weights.vllm_config_class``: vLLM's own config
registry, KimiVLConfig, UltravoxConfig, DeepseekVLV2Config, ..., or a transformers composite such as Kimi_K25Config),
and it must be a composite: a text decoder held as a sub-config beside its encoders. It is shrunk by the rules of
``composite.tiny_composite_config`` (the text sub-config by the text decoders' rules with vLLM's size names,
``vllm_weights.VLLM_CONFIG_SIZES``; each encoder by ENCODER_SIZES plus VLLM_ENCODER_SIZES, the size names of vLLM's
own encoder configs; sizes where parts meet matched by value). The weights are then written from vLLM's side
(``vllm_weights.make_vllm_checkpoint``): vLLM builds the model with ``language_model_only`` (``composite.engine_args``),
so the towers a model marks with ``_mark_tower_model`` are not built and only what is built (the text model, and
the projectors of models that build them) is written and proven by the round trip.

Three other layouts have rules: a text decoder held under a name transformers' ``get_text_config`` does not look
for (BagelConfig's ``llm_config``: TEXT_SUB_CONFIGS); sub-configs that the class's defaults leave out and only the hub
checkpoint fills in (OvisConfig's: HUB_SUB_CONFIGS gives them); and a config class that is the text decoder itself,
its encoders plain dicts of the hub's config.json (GLM-4V's ChatGLMConfig and ``vision_config``, FireRedASR2's
Qwen2Config and ``audio_encoder_conf``: ENCODER_FIELDS, tiny). Any other config that is one part only (Phi-3-vision's
module imports CLIPVisionConfig, its own config is remote code) is NoTinyCheckpoint saying so.
"""

from __future__ import annotations

import copy
import json
from typing import Any

from pytest_enginecheck.targets.vllm.checkpoints import composite
from pytest_enginecheck.targets.vllm.checkpoints.config_dtype import set_float32
from pytest_enginecheck.targets.vllm.checkpoints.shrink import NoTinyCheckpoint, tiny_text_config

# Size fields of vLLM's own encoder configs, where a sub-config has them: DeepseekVLV2's VisionEncoderConfig
# (width, layers, heads) and MlpProjectorConfig (its depth: ENCODER_SIZES), Moondream3's vision config (enc_*).
VLLM_ENCODER_SIZES: dict[str, int] = {
    "width": 64, "layers": 2, "heads": 2,
    "enc_dim": 64, "enc_n_layers": 2, "enc_ff_dim": 128, "enc_n_heads": 2, "proj_inner_dim": 128,
}
# Fields of the hub checkpoints that vLLM's model reads and its config class defaults to None or lacks, by model_type:
# sub-config name ("" for the top level) -> field -> value. FunAudioChat's discrete audio encoder embeds
# ``codebook_size`` tokens padded at ``pad_token_id`` (the tower is built before language_model_only drops it).
HUB_FIELDS: dict[str, dict[str, dict[str, Any]]] = {
    "funaudiochat": {"audio_config": {"codebook_size": 256, "pad_token_id": 0}},
}
# The key a sub-config is read from in the hub's config.json (and passed to the constructor under), where it is not
# the attribute it is held in, by model_type.
SUB_CONFIG_KEYS: dict[str, dict[str, str]] = {"ultravox": {"wrapped_model_config": "text_config"},
                                              "deepseek_vl_v2": {"text_config": "language_config"},
                                              "ovis": {"text_config": "llm_config"}}
# The sub-configs of a config class whose defaults have none (only the hub checkpoint fills them in), as the hub's
# config.json holds them, by model_type: Ovis2's Qwen2 decoder and AIMv2 visual tokenizer (its backbone tiny here,
# one level below what the shrink rules reach).
HUB_SUB_CONFIGS: dict[str, dict[str, Any]] = {
    "ovis": {"llm_config": {"model_type": "qwen2"},
             "visual_tokenizer_config": {
                 "model_type": "aimv2_visual_tokenizer", "hidden_stride": 2,
                 "backbone_config": {"model_type": "aimv2", "hidden_size": 64, "intermediate_size": 128,
                                     "num_hidden_layers": 2, "num_attention_heads": 2, "patch_size": 14,
                                     "image_size": 14 * composite.IMAGE_PATCHES}}},
}
# The path of a sub-config in the hub's config.json, where the constructor reads it from inside another field
# (Moondream3Config's ``config: {"text": ..., "vision": ...}``), by model_type.
SUB_CONFIG_PATHS: dict[str, dict[str, tuple[str, str]]] = {
    "moondream3": {"text_config": ("config", "text"), "vision_config": ("config", "vision")},
}
# Size fields of vLLM's own text sub-configs, where they have them: Moondream3TextConfig's names (its hidden_size and
# the other standard names are derived from these).
VLLM_TEXT_SIZES: dict[str, int] = {"dim": 64, "ff_dim": 128, "n_layers": 2, "n_heads": 2, "n_kv_heads": 2,
                                   "max_context": 256}
# The attribute holding the text decoder where transformers' get_text_config does not look for it, by model_type.
TEXT_SUB_CONFIGS: dict[str, str] = {"bagel": "llm_config"}
# The encoders of a config class that is the text decoder itself, as the hub's config.json holds them (plain dicts vLLM
# reads by key), tiny (ENCODER_SIZES' sizes, an image of IMAGE_PATCHES x IMAGE_PATCHES patches), by architecture:
# GLM-4V's EVA2-CLIP vision_config and its begin/end-of-image token ids (inside the tiny vocabulary); FireRedASR2's
# Conformer audio_encoder_conf (ConformerEncoder's keywords) and its adapter's downsampling.
ENCODER_FIELDS: dict[str, dict[str, Any]] = {
    "GLM4VForCausalLM": {
        "vision_config": {"hidden_size": 64, "num_heads": 2, "num_hidden_layers": 2, "intermediate_size": 128,
                          "patch_size": 14, "image_size": 14 * composite.IMAGE_PATCHES,
                          "num_positions": composite.IMAGE_PATCHES ** 2 + 1, "in_channels": 3, "hidden_act": "gelu",
                          "layer_norm_eps": 1e-6, "dropout_prob": 0.0, "scaling_factor": 8},
        "boi_token_id": 3, "eoi_token_id": 4},
    "FireRedASR2ForConditionalGeneration": {
        "audio_encoder_conf": {"idim": 80, "n_layers_enc": 2, "n_head": 2, "d_model": 64, "kernel_size": 33,
                               "pe_maxlen": 256},
        "encoder_downsample_rate": 2},
}
# Top-level fields the hub config.json copies from the text decoder, which vLLM's model reads there, by model_type.
# Isaac's head_dim: its model sizes the text decoder's M-RoPE sections from the top-level one (IsaacConfig keeps the
# text decoder's fields at the top as well), which vLLM's rotary embedding asserts to add up to half the text head.
TEXT_FIELDS_AT_TOP: dict[str, tuple[str, ...]] = {"ultravox": ("vocab_size",), "ovis": ("hidden_size",),
                                                  "isaac": ("head_dim",)}


def _text_config(config_cls: type, defaults: Any) -> Any:
    """The text sub-config shrunk by the text decoders' rules, with the size names of vLLM's own configs."""
    from pytest_enginecheck.targets.vllm.checkpoints.shrink import VLLM_CONFIG_SIZES

    return tiny_text_config(config_cls, defaults, {**VLLM_CONFIG_SIZES, **VLLM_TEXT_SIZES})


TEXT_SIZE_FIELDS = ("hidden_size", "num_hidden_layers", "vocab_size", "num_attention_heads")


def _text(model_type: str, config: Any) -> Any:
    """The text decoder's config of ``config`` (of ``model_type``): its TEXT_SUB_CONFIGS attribute, else
    ``get_text_config()``."""
    name = TEXT_SUB_CONFIGS.get(model_type)
    return getattr(config, name) if name else config.get_text_config()


def _text_sizes(model_type: str, config: Any) -> dict[str, Any]:
    text = _text(model_type, config)
    return {k: getattr(text, k, None) for k in TEXT_SIZE_FIELDS}


class HubLayoutConfig:
    """A tiny config as vLLM parses it (``config``: the class's ``from_dict`` of ``saved``) that writes its
    config.json in the hub checkpoint's layout (``saved``): vLLM's own composite configs read a sub-config under
    another key than their ``to_dict`` writes it (UltravoxConfig's ``wrapped_model_config`` is the hub's
    ``text_config``), so the config object's own JSON would not parse back into the tiny model."""

    def __init__(self, config: Any, saved: dict[str, Any]) -> None:
        self.config = config
        self.saved = saved

    def to_json_string(self, use_diff: bool = True) -> str:
        """The hub layout's config.json (``use_diff`` is ignored: every field is written)."""
        return json.dumps(self.saved, indent=2, sort_keys=True) + "\n"

    def __getattr__(self, name: str) -> Any:
        return getattr(self.config, name)


def _hub_layout(architecture: str, model_type: str, config: Any) -> dict[str, Any]:
    """``config``'s config.json in the hub checkpoint's layout: sub-configs under SUB_CONFIG_KEYS, HUB_FIELDS (and the
    text decoders', ``vllm_configs.HUB_FIELDS``), ENCODER_FIELDS and TEXT_FIELDS_AT_TOP set."""
    from pytest_enginecheck.targets.vllm.checkpoints import vllm_configs

    saved: dict[str, Any] = json.loads(config.to_json_string(use_diff=False))
    saved.update({**vllm_configs.HUB_FIELDS.get(model_type, {}), **ENCODER_FIELDS.get(architecture, {})})
    for name, key in SUB_CONFIG_KEYS.get(model_type, {}).items():
        saved[key] = json.loads(getattr(config, name).to_json_string(use_diff=False))
        saved.pop(name, None)
    for name, (field, key) in SUB_CONFIG_PATHS.get(model_type, {}).items():
        saved.setdefault(field, {})[key] = json.loads(getattr(config, name).to_json_string(use_diff=False))
        saved.pop(name, None)
    for name, fields in HUB_FIELDS.get(model_type, {}).items():
        (saved[name] if name else saved).update(fields)
    for field in TEXT_FIELDS_AT_TOP.get(model_type, ()):
        saved[field] = getattr(config.get_text_config(), field)
    return saved


def _read_back(model_type: str, config_cls: type, config: Any, saved: dict[str, Any]) -> Any:
    """``saved`` (the tiny ``config``'s config.json) parsed by ``config_cls`` as vLLM parses it; NoTinyCheckpoint
    where that is not the tiny text decoder (a constructor that reads the text sub-config under a key no
    SUB_CONFIG_KEYS entry names)."""
    try:
        parsed = config_cls.from_dict(copy.deepcopy(saved))  # type: ignore[attr-defined] # OvisConfig pops keys
        read = _text_sizes(model_type, parsed)
    except Exception as e:  # noqa: BLE001 - the class refuses the tiny config.json
        raise NoTinyCheckpoint(f"{config_cls.__name__} cannot read back the tiny config.json: "
                               f"{type(e).__name__}: {e}") from None
    written = _text_sizes(model_type, config)
    if read != written:
        raise NoTinyCheckpoint(f"{config_cls.__name__} reads the tiny config.json with another text decoder ({read} "
                               f"for {written}): it reads a sub-config under another key than it "
                               f"writes it, and no rule of the checker names that key")
    return parsed


def tiny_multimodal_config(architecture: str, model_cls: type) -> HubLayoutConfig:
    """The tiny composite config vLLM parses multimodal ``architecture``'s checkpoint with (the module docstring);
    NoTinyCheckpoint naming the reason where there is none."""
    from pytest_enginecheck.targets.vllm.checkpoints.vllm_configs import vllm_config_class

    model_type, config_cls = vllm_config_class(architecture, model_cls)
    try:
        defaults = config_cls(**copy.deepcopy(HUB_SUB_CONFIGS.get(model_type, {})))
    except Exception as e:  # noqa: BLE001 - the config needs arguments the checker cannot know
        raise NoTinyCheckpoint(f"{config_cls.__name__}() (vLLM's config of model_type {model_type!r}) cannot be built "
                               f"with its defaults: {type(e).__name__}: {e}") from None
    text_name = TEXT_SUB_CONFIGS.get(model_type, "")
    if architecture in ENCODER_FIELDS:
        config = _text_config(config_cls, defaults)  # the text decoder itself: its encoders are ENCODER_FIELDS
    elif text_name or (composite.is_composite(defaults) and defaults.get_text_config() is not defaults):
        config = composite.tiny_composite_config(config_cls, defaults, _text_config, VLLM_ENCODER_SIZES,
                                                 SUB_CONFIG_KEYS.get(model_type), text_name)
    else:
        raise NoTinyCheckpoint(
            f"the config class vLLM resolves for the multimodal {architecture} ({config_cls.__name__}, model_type "
            f"{model_type!r}) holds no text decoder as a sub-config beside its encoders: its encoders' configs "
            f"come from the hub checkpoint (remote code), which no shrink rule knows")
    text = _text(model_type, config)
    for part in (config,) if text is config else (config, text):
        if not hasattr(part, "tie_word_embeddings"):  # transformers 5's base config has none; vLLM's models read it
            part.tie_word_embeddings = False
    config.architectures = [architecture]
    set_float32(config)  # issue 34: the field older transformers reads and saves (config_dtype.py)
    saved = _hub_layout(architecture, model_type, config)
    return HubLayoutConfig(_read_back(model_type, config_cls, config, saved), saved)
