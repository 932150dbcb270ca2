"""What the vLLM target's tiny checkpoints hold that a bug can show in, and what an out-of-tree class declares for them:
every parameter transformers' initialisation leaves constant (biases, norm weights) gets random values around that
constant, the tiny config groups its query heads over one KV head, and ``enginecheck_config`` (a dict or a function
returning one) is set on the tiny config, making the checkpoint of a subclass that reads a field its base config has
not. Runs transformers only (no vLLM)."""

from __future__ import annotations

import importlib
import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from pytest_enginecheck.targets.vllm.checkpoints.declared import ConfigDeclarationError, declared_config
from pytest_enginecheck.targets.vllm.checkpoints.from_transformers import (
    foreign_base,
    make_hf_checkpoint,
    tiny_config,
    vary_constant_parameters,
)

SCALED = '''\
import transformers


class ScaledLlama(transformers.LlamaForCausalLM):
    enginecheck_config = {"embedding_multiplier": 2.0}

    def __init__(self, config):
        super().__init__(config)
        self.scale = config.embedding_multiplier
'''


@pytest.fixture(autouse=True)
def no_tokenizer(monkeypatch: pytest.MonkeyPatch) -> None:
    """The checkpoint's last step asks vLLM's registry whether the architecture reads a tokenizer: not here (no vLLM,
    and a text decoder's tiny checkpoint runs without one)."""
    from pytest_enginecheck.targets.vllm.checkpoints import tokenizer

    monkeypatch.setattr(tokenizer, "write_tokenizer_if_needed", lambda *args: None)


@pytest.fixture
def scaled_llama(tmp_path: Path) -> Iterator[Any]:
    """An out-of-tree Llama subclass (a module file of its own) reading a config field LlamaConfig has not."""
    (tmp_path / "enginecheck_scaled_llama.py").write_text(SCALED)
    sys.path.insert(0, str(tmp_path))
    try:
        yield importlib.import_module("enginecheck_scaled_llama").ScaledLlama
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop("enginecheck_scaled_llama", None)


def test_every_bias_and_norm_of_the_tiny_checkpoint_is_random_and_its_kv_heads_are_grouped(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    make_hf_checkpoint("Qwen2ForCausalLM", tmp_path)  # Qwen2: q/k/v biases, which transformers initialises to 0
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["num_key_value_heads"] == 1 < config["num_attention_heads"]
    tensors = load_file(str(tmp_path / "model.safetensors"))
    biases = [n for n in tensors if n.endswith("bias")]
    norms = [n for n in tensors if "norm" in n]
    assert biases and norms
    for name in [*biases, *norms]:
        values = tensors[name]
        assert values.unique().numel() == values.numel(), f"{name} is not random: {values}"
    assert all(0.5 < float(tensors[n].mean()) < 1.5 for n in norms)  # around 1
    assert all(abs(float(tensors[n].mean())) < 0.05 for n in biases)  # around 0


def test_varying_leaves_random_tensors_and_scalars_as_they_are() -> None:
    import torch

    model = torch.nn.Module()
    model.weight = torch.nn.Parameter(torch.randn(4, 4))
    model.scale = torch.nn.Parameter(torch.ones(1))
    model.norm = torch.nn.Parameter(torch.ones(8))
    before = model.weight.detach().clone()
    assert vary_constant_parameters(model) == ["norm"]
    assert torch.equal(model.weight, before) and model.scale.item() == 1.0
    assert model.norm.detach().unique().numel() == 8


def test_a_declared_config_makes_the_checkpoint_of_a_subclass_its_base_config_cannot(scaled_llama: Any,
                                                                                    tmp_path: Path) -> None:
    import transformers

    assert foreign_base("ScaledLlama", scaled_llama, transformers.LlamaForCausalLM) == ""
    assert tiny_config("ScaledLlama", scaled_llama).embedding_multiplier == 2.0
    make_hf_checkpoint("ScaledLlama", tmp_path, scaled_llama)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["embedding_multiplier"] == 2.0 and config["architectures"] == ["ScaledLlama"]

    del scaled_llama.enginecheck_config  # undeclared, the base config lacks what it reads: says how to declare it
    reason = foreign_base("ScaledLlama", scaled_llama, transformers.LlamaForCausalLM)
    assert "reads the config field embedding_multiplier" in reason and "enginecheck_config" in reason


def test_a_declared_config_may_be_a_function_and_a_bad_one_names_the_fix() -> None:
    class Declares:
        enginecheck_config = staticmethod(lambda: {"use_scale": True})

    assert declared_config("Declares", Declares) == {"use_scale": True}
    assert declared_config("Plain", object) == {}
    for value in (["use_scale"], {1: True}, {"when": object()}):
        Declares.enginecheck_config = value  # type: ignore[assignment]
        with pytest.raises(ConfigDeclarationError, match=r"Declares\.enginecheck_config .*set enginecheck_config on "
                                                         r"Declares's class to a dict of config\.json fields"):
            declared_config("Declares", Declares)

    def fails() -> dict[str, Any]:
        raise KeyError("hidden_size")

    Declares.enginecheck_config = staticmethod(fails)  # type: ignore[assignment]
    with pytest.raises(ConfigDeclarationError, match=r"Declares\.enginecheck_config\(\) raised KeyError"):
        declared_config("Declares", Declares)
