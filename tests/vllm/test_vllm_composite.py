"""Composite (multimodal) architectures: tiny checkpoints with every part shrunk consistently (composite.py), vLLM's
load check on them with text-only prompts, and the import verdict where torch's CPU build has no torchvision."""

from __future__ import annotations

from typing import Any

import pytest

from pytest_enginecheck.checks import CheckContext, CheckFailure, CheckSkip
from pytest_enginecheck.settings import Settings

VISION = "PaliGemmaForConditionalGeneration"  # SigLIP tower + projector + Gemma
AUDIO = "Qwen2AudioForConditionalGeneration"  # Whisper-like encoder + projector + Qwen2; transformers doubles a prefix


def _made(workdir: str) -> dict[str, Any]:
    import json
    from pathlib import Path

    from safetensors import safe_open

    from pytest_enginecheck.targets.vllm.checkpoints.tiny import make_tiny_checkpoint

    made = {}
    for architecture in (VISION, AUDIO):
        path = make_tiny_checkpoint(architecture, Path(workdir) / architecture)
        with safe_open(str(path / "model.safetensors"), "pt") as f:
            shapes = {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}  # noqa: SIM118
        made[architecture] = (json.loads((path / "config.json").read_text()), shapes)
    return made


def test_composite_checkpoints_shrink_every_part_consistently(in_child: Any, tmp_path: Any) -> None:
    made = in_child(_made, str(tmp_path))
    config, shapes = made[VISION]
    text, vision = config["text_config"], config["vision_config"]
    assert (text["hidden_size"], text["num_hidden_layers"], text["vocab_size"]) == (64, 2, 256)
    assert (vision["hidden_size"], vision["num_hidden_layers"], vision["num_attention_heads"]) == (64, 2, 2)
    assert vision["image_size"] == 4 * vision["patch_size"] and text["num_image_tokens"] == 16
    # the projector meets both: vision hidden size in, text hidden size out (PaliGemma's projection_dim)
    assert config["projection_dim"] == text["hidden_size"]
    assert shapes["multi_modal_projector.linear.weight"] == (text["hidden_size"], vision["hidden_size"])
    assert shapes["vision_tower.embeddings.position_embedding.weight"] == (16, 64)
    config, shapes = made[AUDIO]
    assert (config["audio_config"]["d_model"], config["audio_config"]["encoder_layers"]) == (64, 2)
    # the original layout vLLM loads, not transformers 5's doubled language_model.model.model.*
    assert "language_model.model.embed_tokens.weight" in shapes
    assert not [name for name in shapes if ".model.model." in name]
    assert {name.split(".")[0] for name in shapes} == {"audio_tower", "language_model", "multi_modal_projector"}


def _load(workdir: str, architecture: str, tp: int) -> Any:
    import os

    from pytest_enginecheck.targets.vllm.checks import CHECK_FUNCTIONS

    os.environ["VLLM_PLUGINS"] = "clean"
    ctx = CheckContext(check="load", spec="vllm", architecture=architecture, module="", class_name="",
                       workdir=workdir, tp=tp, options=Settings(timeout=300.0))
    try:
        return CHECK_FUNCTIONS["load"](ctx)
    except (CheckFailure, CheckSkip) as e:
        return f"{type(e).__name__}: {e}"


@pytest.mark.parametrize("architecture, tp", [(VISION, 1), (AUDIO, 2)])
def test_load_runs_a_composite_model_on_text_prompts(in_child: Any, tmp_path: Any, architecture: str,
                                                     tp: int) -> None:
    detail = in_child(_load, str(tmp_path), architecture, tp)
    assert isinstance(detail, dict), detail
    assert detail["tensor_parallel_size"] == tp and [len(t) for t in detail["tokens"]] == [6, 6, 6]
    if tp > 1:  # the same greedy tokens and log-probabilities as at TP=1
        assert detail["max_logprob_difference"] <= detail["logprob_tolerance"]


def _import(workdir: str, architecture: str, module: str) -> Any:
    import os

    from pytest_enginecheck.targets.vllm.checks import CHECK_FUNCTIONS

    os.environ["VLLM_PLUGINS"] = "clean"
    ctx = CheckContext(check="import", spec="vllm", architecture=architecture, module=module,
                       class_name=architecture, workdir=workdir)
    try:
        return CHECK_FUNCTIONS["import"](ctx)
    except CheckFailure as e:
        return e.message, e.detail.get("dependency")


def test_import_without_torchvision_says_why_it_is_missing(in_child: Any, tmp_path: Any) -> None:
    import importlib.metadata
    import importlib.util

    if importlib.util.find_spec("torchvision") is not None or not importlib.metadata.version("torch").endswith("+cpu"):
        pytest.skip("needs the vllm tier's venv: torch's CPU build, torchvision uninstalled (.ci/vllm-venv)")
    message, dependency = in_child(_import, str(tmp_path), "Qwen2VLForConditionalGeneration",
                                   "vllm.model_executor.models.qwen2_vl")
    assert dependency == "torchvision"
    assert message.startswith("Importing vllm.model_executor.models.qwen2_vl failed: it imports 'torchvision', "
                              "which is not installed. torch here is the CPU build (2.")
    assert "PyPI's torchvision wheels are built for PyPI's CUDA torch" in message
    assert "https://download.pytorch.org/whl/cpu" in message
