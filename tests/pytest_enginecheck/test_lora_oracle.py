"""lora[tp=1]'s reference oracle on engine_ref (targets/engine_ref/lora_oracle.py) and the shared PEFT reference
(pytest_enginecheck/lora_reference.py), in this process on a real tiny Llama, its PEFT adapter and transformers +
PEFT: a LoRA target inside a packed layer is named under PEFT's name (``v_proj`` of engine_ref's ``qkv_proj``), and
a missing peft says what to install. The planted models run as ``pytest --enginecheck`` in test_lora_check.py."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from pytest_enginecheck.checks import CheckContext
from pytest_enginecheck.lora_reference import load_peft_reference, peft_unavailable
from pytest_enginecheck.reference import find_reference
from pytest_enginecheck.targets.engine_ref import lora_oracle
from pytest_enginecheck.targets.engine_ref.reference import first_differing_module

ARCH = "LlamaForCausalLM"
TOKENS = [3, 10, 17, 24, 31, 38, 45, 52]


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Any, Any, Any]]:
    """The engine's TP=1 Llama with its LoRA layers and the adapter on (lora_tp1_model), its switch, and
    transformers' Llama with PEFT's adapter (its base model: transformers' module names)."""
    from engine_ref.lora.checkpoint import make_lora
    from engine_ref.model_executor.model_loader.checkpoint import make_checkpoint
    from engine_ref.model_executor.models.registry import ModelRegistry

    workdir = tmp_path_factory.mktemp("lora-oracle")
    ckpt = make_checkpoint(ARCH, workdir / ARCH)
    adapter = make_lora(ckpt, workdir / "adapter", r=8, seed=0)
    ctx = CheckContext(check="lora", spec="engine_ref", architecture=ARCH, module="", class_name="",
                       workdir=str(workdir))
    reference = find_reference(ARCH, ModelRegistry.resolve_model_cls(ARCH))
    assert reference is not None
    ref = load_peft_reference(reference, Path(ckpt), adapter).get_base_model()
    with lora_oracle.lora_tp1_model(ctx, Path(ckpt), adapter, max_lora_rank=8) as (model, switch):
        yield model, switch, ref


def test_a_packed_sub_projection_that_loses_its_adapter_is_named_by_peft_name(models: tuple[Any, Any, Any]) -> None:
    """Layer 1's v rows of B zeroed in the engine's slot: the first module that parts is v_proj, which engine_ref
    computes as columns of qkv_proj (an Alias); without the aliases only the attention around it can be named."""
    import torch

    model, switch, ref = models
    aliases = lora_oracle.lora_aliases(switch.manager)
    assert first_differing_module(model, ref, TOKENS, aliases)[0] is None  # the clean adapter: nothing parts
    qkv = switch.manager.modules["model.layers.1.self_attn.qkv_proj"]
    offset, size, _ = qkv.base_layer.output_shard("v")
    saved = qkv.lora_b_stacked.clone()
    try:
        with torch.inference_mode():
            qkv.lora_b_stacked[:, offset:offset + size] = 0
        module, compared = first_differing_module(model, ref, TOKENS, aliases)
        assert (module, aliases[module].columns) == ("model.layers.1.self_attn.v_proj", (offset, offset + size))
        assert compared > len(aliases)
        assert first_differing_module(model, ref, TOKENS)[0] == "model.layers.1.self_attn"
        assert lora_oracle.wrappers_not_called(model, TOKENS) == []  # the wrapper ran: its product is wrong
    finally:
        with torch.inference_mode():
            qkv.lora_b_stacked.copy_(saved)


def test_peft_missing_says_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    assert peft_unavailable() is None
    monkeypatch.setitem(sys.modules, "peft", None)  # an import of peft raises ImportError
    assert peft_unavailable() == ("peft cannot be imported here (ModuleNotFoundError: import of peft halted; None in "
                                  "sys.modules); install it: pip install peft (constraints.txt pins peft)")


def test_peft_without_accelerate_says_to_install_both(monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM's venv installs peft with --no-deps: without accelerate, peft's own import fails on it."""
    for name in [name for name in sys.modules if name.split(".")[0] in ("peft", "accelerate")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "accelerate", None)
    before = set(sys.modules)
    try:
        missing = peft_unavailable()
    finally:  # what the failed import left behind goes; monkeypatch puts back what was there
        for name in set(sys.modules) - before:
            del sys.modules[name]
    assert missing is not None and missing.endswith("; install it: pip install peft accelerate (constraints.txt pins "
                                                    "peft)"), missing
