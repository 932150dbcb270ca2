"""Tiny composite (multimodal) configs: a text decoder beside vision, audio or projector sub-configs.

vLLM's own tests shrink such a model by overriding each sub-config's layer count (its ``dummy_hf_overrides``)
and run it with dummy weights. Here the checkpoint is real (transformers writes the weights), so every size is
shrunk, consistently:

- the text sub-config (``get_text_config()``) by the text decoders' rules (``checkpoints.tiny_text_config``);
- every other sub-config by ENCODER_SIZES where it has the field, its image to IMAGE_PATCHES x IMAGE_PATCHES
  patches (``image_size = patch_size * IMAGE_PATCHES``), the image's token counts to match;
- a size that meets another part of the model (a projector's input is the vision hidden size, Voxtral's top-level
  ``hidden_size`` is the text model's, Blip-2's Q-Former ``encoder_hidden_size`` is the vision model's) is found
  by value: any field anywhere in the config whose default equals a default hidden or vocabulary size of a part
  takes that part's tiny size (``_dimensions``).

The engine checks then run vLLM with text-only prompts and ``language_model_only`` (``engine_args``): vLLM's
multimodal processor needs a tokenizer, which the tiny checkpoints do not have, and its towers marked with
``_mark_tower_model`` are not built in that mode.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Collection, Mapping
from pathlib import Path
from typing import Any

# An encoder's sizes, where its config has the field (the names vision, audio and Q-Former configs use).
ENCODER_SIZES: dict[str, int] = {
    "hidden_size": 64, "embed_dim": 64, "d_model": 64, "hidden_dim": 64, "out_hidden_size": 64,
    "intermediate_size": 128, "encoder_ffn_dim": 128,
    "num_hidden_layers": 2, "num_layers": 2, "depth": 2, "encoder_layers": 2, "conf_num_hidden_layers": 2,
    "num_attention_heads": 2, "num_heads": 2, "encoder_attention_heads": 2, "num_key_value_heads": 2,
    "conf_num_attention_heads": 2, "head_dim": 32, "dim_head": 32, "vocab_size": 256,
    # an encoder-decoder's decoder (Whisper's, also as an audio sub-config): its heads must divide d_model too
    "decoder_attention_heads": 2, "decoder_layers": 2, "decoder_ffn_dim": 128,
}
# The decoder of an encoder-decoder text config (Whisper): transformers' attribute_map names only the encoder's sizes
# (hidden_size -> d_model, num_attention_heads -> encoder_attention_heads), so the text rules miss these.
DECODER_SIZES = ("decoder_attention_heads", "decoder_layers", "decoder_ffn_dim")
# An encoder-decoder's encoder positions (Whisper's 1500 audio frames after its convolutions): vLLM's encoder budget
# (v1/core/encoder_cache_manager.py) refuses an item of more tokens than engine.ENGINE_ARGS' max_num_batched_tokens.
ENCODER_POSITIONS = {"max_source_positions": 64}
IMAGE_PATCHES = 4  # patches per side of the tiny image
# The image's token count, where the composite (or a sub-config) states it: IMAGE_PATCHES ** 2, one per patch.
IMAGE_TOKEN_FIELDS = ("image_seq_length", "mm_tokens_per_image", "num_image_tokens")
MIN_DIMENSION = 256  # a default this large that equals a part's hidden or vocabulary size is taken to be it


def is_composite(defaults: Any) -> bool:
    """Whether the default config ``defaults`` holds its text decoder as a sub-config (Llava's ``text_config``)."""
    get_text_config = getattr(defaults, "get_text_config", None)
    return (bool(_sub_configs(defaults)) and callable(get_text_config) and get_text_config() is not defaults) \
        or _is_encoder_decoder(defaults)


def _is_encoder_decoder(defaults: Any) -> bool:
    """Whether ``defaults`` is an encoder-decoder config with decoder sizes of its own (Whisper's)."""
    return bool(getattr(defaults, "is_encoder_decoder", False)) and any(k in _ints(defaults) for k in DECODER_SIZES)


def _sub_configs(defaults: Any) -> dict[str, Any]:
    """The default sub-configs by attribute name (those that are set): the class's declared ``sub_configs``, and any
    other attribute that is a config (vLLM's own composite configs declare none: DeepseekVLV2Config, UltravoxConfig)."""
    from transformers import PretrainedConfig

    declared = {name: sub for name in getattr(type(defaults), "sub_configs", None) or {}
                if (sub := getattr(defaults, name, None)) is not None}
    held = {name: sub for name, sub in vars(defaults).items() if isinstance(sub, PretrainedConfig)}
    return {**declared, **held}


def _ints(config: Any) -> dict[str, int]:
    return {k: v for k, v in config.to_dict().items() if isinstance(v, int) and not isinstance(v, bool)}


def _dimensions(defaults: Any, text: Any, tiny_text: Any) -> dict[int, int]:
    """Default hidden / vocabulary size -> tiny size, for every part: the text decoder's (``text``), each encoder's."""
    dims = {}
    for sub in _sub_configs(defaults).values():
        if sub is text:
            continue
        for field in ("hidden_size", "embed_dim", "d_model", "hidden_dim", "vocab_size"):
            value = _ints(sub).get(field)
            if value is not None and value >= MIN_DIMENSION:
                dims[value] = ENCODER_SIZES[field]
    # The text decoder's last: where an encoder's size equals it, the text model's tiny size wins.
    for field in ("hidden_size", "vocab_size"):
        value, tiny = _ints(text).get(field), getattr(tiny_text, field, None)
        if value is not None and value >= MIN_DIMENSION and isinstance(tiny, int):
            dims[value] = tiny
    return dims


def _is_token_id(name: str) -> bool:
    return name.endswith(("_id", "_index", "_ids")) or name.startswith("vocab_offset")


def _by_dimension(config: Any, dims: dict[int, int]) -> dict[str, int]:
    """The fields of ``config`` whose default is a part's hidden or vocabulary size, at that part's tiny size."""
    return {k: dims[v] for k, v in _ints(config).items() if v in dims and not _is_token_id(k)}


def _image(config: Any) -> dict[str, int]:
    """The tiny image of an encoder with ``image_size`` and ``patch_size``, and its token counts."""
    fields = _ints(config)
    sizes = {k: IMAGE_PATCHES ** 2 for k in IMAGE_TOKEN_FIELDS if k in fields}
    if "patch_size" in fields and "image_size" in fields:
        sizes["image_size"] = fields["patch_size"] * IMAGE_PATCHES
    return sizes


def _rebuilt(config: Any, sizes: dict[str, Any], subs: dict[str, Any] | None = None,
             exclude: Collection[str] = ()) -> Any:
    """``config``'s class built from ``config``'s own values (less ``exclude``) with ``sizes`` (and the tiny
    sub-configs ``subs``, by constructor keyword) over them, so its validators run; NoTinyCheckpoint where they
    refuse."""
    from pytest_enginecheck.targets.vllm.checkpoints.shrink import NoTinyCheckpoint

    subs = subs or {}
    values = {k: v for k, v in config.to_diff_dict().items()
              if k not in ("transformers_version", "model_type", "architectures", *subs, *exclude)}
    try:
        return type(config)(**{**values, **sizes, **subs})
    except Exception as e:  # noqa: BLE001 - TypeError, ValueError, huggingface_hub's StrictDataclass*Error, ...
        error = e
    if subs:  # a constructor that takes its sub-configs as dicts only (vLLM's DeepseekVLV2Config: ``Class(**d)``)
        try:
            return type(config)(**{**values, **sizes, **{k: v.to_dict() for k, v in subs.items()}})
        except Exception:  # noqa: BLE001 - told by the first error
            pass
    raise NoTinyCheckpoint(f"{type(config).__name__} refuses the tiny sizes {sizes}: {type(error).__name__}: {error}")


def tiny_composite_config(config_cls: type, defaults: Any, tiny_text_config: Callable[[type, Any], Any],
                          encoder_sizes: Mapping[str, int] | None = None, keys: Mapping[str, str] | None = None,
                          text_name: str = "") -> Any:
    """``config_cls``'s tiny config from its default ``defaults``: the text sub-config by ``tiny_text_config``
    (``(config class, default config) -> tiny config``, which raises NoTinyCheckpoint), every other sub-config
    and the top level shrunk as the module docstring says (``encoder_sizes``: more encoder size fields, by name, over
    ENCODER_SIZES; ``keys``: the constructor keyword of a sub-config whose attribute has another name, as vLLM's
    UltravoxConfig takes ``text_config`` and holds ``wrapped_model_config``; ``text_name``: the attribute holding the
    text decoder where ``get_text_config`` does not look, BagelConfig's ``llm_config``); NoTinyCheckpoint where a
    config refuses its sizes. An encoder-decoder text config (Whisper) is shrunk by the text decoders' rules plus
    ENCODER_SIZES' decoder fields and ENCODER_POSITIONS."""
    if _is_encoder_decoder(defaults) and defaults.get_text_config() is defaults:
        tiny = tiny_text_config(config_cls, defaults)
        sizes = {**{k: ENCODER_SIZES[k] for k in DECODER_SIZES}, **ENCODER_POSITIONS}
        return _rebuilt(tiny, {k: v for k, v in sizes.items() if k in _ints(defaults)})
    encoder_sizes = {**ENCODER_SIZES, **(encoder_sizes or {})}
    text = getattr(defaults, text_name) if text_name else defaults.get_text_config()
    tiny_text = tiny_text_config(type(text), text)
    dims = _dimensions(defaults, text, tiny_text)
    subs = {}
    for name, sub in _sub_configs(defaults).items():
        if sub is text:
            subs[name] = tiny_text
            continue
        fields = _ints(sub)
        sizes = {**_by_dimension(sub, dims), **{k: v for k, v in encoder_sizes.items() if k in fields}, **_image(sub)}
        subs[name] = _rebuilt(sub, sizes)
    top = {k: v for k, v in {**_by_dimension(defaults, dims), **_image(defaults)}.items() if k not in subs}
    keys = keys or {}
    return _rebuilt(defaults, top, {keys.get(name, name): sub for name, sub in subs.items()}, exclude=subs)


def engine_args(ckpt: str) -> dict[str, Any]:
    """vLLM's arguments for the checkpoint at ``ckpt``: ``language_model_only`` for a composite one (a config.json
    with a ``text_config``) or a decoder-only one of an architecture vLLM lists as multimodal (Moondream3's text and
    vision configs are ``config.text`` and ``config.vision``), so vLLM builds no multimodal processor (it needs a
    tokenizer) and runs text prompts. Not for an encoder-decoder (Whisper): its decoder needs the encoder's output."""
    with open(os.path.join(ckpt, "config.json")) as f:
        config = json.load(f)
    text_only = isinstance(config.get("text_config"), dict) \
        or (not config.get("is_encoder_decoder") and _is_multimodal(config))
    return {"language_model_only": True} if text_only else {}


def _is_multimodal(config: Mapping[str, Any]) -> bool:
    """Whether the config.json ``config`` names an architecture vLLM's registry lists as multimodal."""
    from pytest_enginecheck.targets.vllm.probe import probe

    kinds = probe().model_kinds
    return any(kinds.get(architecture) == "multimodal" for architecture in config.get("architectures") or ())


def _collapsed(name: str) -> str:
    """``name`` with each run of ``model`` path segments collapsed to one (``a.model.model.b`` -> ``a.model.b``)."""
    parts = name.split(".")
    return ".".join(p for i, p in enumerate(parts) if not (p == "model" and i and parts[i - 1] == "model"))


def undo_doubled_prefixes(path: Path, model: Any) -> list[str]:
    """Repair what transformers' writer did to a composite model's weight names; return the names repaired.

    ``save_pretrained`` writes the original (pre-v5) layout by reversing transformers' conversion mapping, and for a
    model whose mapping also names its inner model (qwen2_audio's ``Qwen2AudioModel`` rule, which Voxtral, Audio
    Flamingo 3 and GLM-ASR share; granite_speech's) it reverses the inner rule too: ``language_model.model.model.
    layers.0`` where the original layout, and vLLM's loader, have ``language_model.model.layers.0`` (transformers
    reads its own doubled names back, so a round trip does not show it). Where the model's own parameter names never
    have ``model.model``, each such run in the written names is collapsed to one ``model``."""
    from safetensors.torch import load_file, save_file

    if any(_collapsed(name) != name for name in model.state_dict()):
        return []  # the model itself nests a model in a model: its names are what they are
    repaired = []
    for file in sorted(Path(path).glob("*.safetensors")):
        tensors = load_file(file)
        if all(_collapsed(name) == name for name in tensors):
            continue
        repaired += [name for name in tensors if _collapsed(name) != name]
        save_file({_collapsed(name): tensor for name, tensor in tensors.items()}, file, metadata={"format": "pt"})
    return repaired
