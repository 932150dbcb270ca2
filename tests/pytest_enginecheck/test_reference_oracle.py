"""load[tp=1]'s reference oracle (targets/engine_ref/reference.py) through one ``pytest --enginecheck`` session over
zoo.reference_registry: each planted bug, the same at every seed, TP size and KV-cache use, fails load[tp=1] naming
the module where it was planted (layer 1 or later); each clean twin passes, including a subclass that computes
something else on purpose and declares its own reference; a model with no reference passes held to
self-consistency, and the summary says so. Pure tests of the reference's lookup and the module comparison follow.
"""

from __future__ import annotations

from itertools import takewhile
from typing import Any, ClassVar

import pytest

from pytest_enginecheck import reference as lookup
from pytest_enginecheck.targets.engine_ref import reference
from tests.zoo_sessions import REFERENCE, ZooSession, zoo_session

ZOO_SESSIONS = {"oracle_session": "reference"}
ITEM = "load[tp=1]"
LLAMA = "transformers' LlamaForCausalLM"
# arch -> (outcome, the module the failure names: None for a pass; "" for a failure that names none)
EXPECTED: dict[str, tuple[str, str | None]] = {
    "CleanRefLlamaForCausalLM": ("passed", None),
    "ScaledEmbedLlamaForCausalLM": ("passed", None),
    "NoRefLlamaForCausalLM": ("passed", None),
    "SwapLayersRefLlamaForCausalLM": ("failed", "model.layers.1.input_layernorm"),
    "RopeDefaultRefLlamaForCausalLM": ("failed", "model.layers.1.self_attn"),
    "OverwrittenNormRefLlamaForCausalLM": ("failed", "model.layers.1.post_attention_layernorm"),
    "GeluRefLlamaForCausalLM": ("failed", "model.layers.1.mlp"),
    "TiedHeadRefLlamaForCausalLM": ("failed", ""),
    "ScaledEmbedWrongRefLlamaForCausalLM": ("failed", "model.layers.0.self_attn"),
}


@pytest.fixture(scope="module")
def oracle_session(tmp_path_factory: pytest.TempPathFactory) -> ZooSession:
    return zoo_session(tmp_path_factory, "reference", *REFERENCE)


def test_every_planted_bug_fails_load_naming_its_module_and_every_twin_passes(oracle_session: ZooSession) -> None:
    results = oracle_session.results
    assert {arch: results[(arch, ITEM)]["outcome"] for arch in EXPECTED} == \
        {arch: outcome for arch, (outcome, _) in EXPECTED.items()}, oracle_session.stdout
    for arch, (outcome, module) in EXPECTED.items():
        result = results[(arch, ITEM)]
        if outcome == "failed":
            assert result["message"].startswith(f"{arch} at tensor_parallel_size=1 does not compute what {LLAMA} "
                                                f"computes on the same tiny checkpoint (float32)"), result["message"]
            assert result["detail"]["kind"] == "reference_mismatch"
            assert result["detail"]["module"] == (module or None)
            assert result["detail"]["difference"] > reference.LOGPROB_TOLERANCE
    tied = results[("TiedHeadRefLlamaForCausalLM", ITEM)]["message"]
    assert "none's output differs where its input agrees: the logits part after them (compute_logits, lm_head" in tied
    assert oracle_session.returncode == 1


def test_each_result_says_which_oracle_it_used(oracle_session: ZooSession) -> None:
    results = oracle_session.results
    assert results[("CleanRefLlamaForCausalLM", ITEM)]["detail"]["reference"] == LLAMA
    assert results[("ScaledEmbedLlamaForCausalLM", ITEM)]["detail"]["reference"] == \
        "the declared zoo.planted_reference:HFScaledEmbedLlamaForCausalLM"
    norefs = results[("NoRefLlamaForCausalLM", ITEM)]["detail"]
    assert norefs["oracle"] == "self" and "declares no enginecheck_reference" in norefs["oracle_why"]
    lines = oracle_session.stdout.splitlines()  # the summary's oracle line, wrapped to the terminal, joined back
    at = next(i for i, line in enumerate(lines) if line.startswith(f"{ITEM} oracle:"))
    wrapped = [lines[at], *takewhile(lambda part: part.startswith("  "), lines[at + 1:])]
    line = " ".join(part.strip() for part in wrapped)
    held = {arch for (arch, item), r in results.items() if item == ITEM and r["detail"].get("oracle") == "reference"}
    assert set(EXPECTED) - {"NoRefLlamaForCausalLM"} <= held  # and the other zoo files' models the session runs
    assert f"{len(held)} against a reference implementation" in line
    assert line.endswith("1 self-consistency only (two seeds, KV cache against recomputing, TP sizes): "
                         "NoRefLlamaForCausalLM"), line


class _Declares:
    enginecheck_reference: ClassVar[Any] = None


@pytest.mark.parametrize(("declared", "found"), [
    (None, "transformers' LlamaForCausalLM"),  # the architecture's own name
    ("LlamaForCausalLM", "transformers' LlamaForCausalLM"),
    ("transformers:MistralForCausalLM", "the declared transformers:MistralForCausalLM"),
])
def test_the_reference_is_the_declared_one_else_the_architectures_own(declared: Any, found: str) -> None:
    cls = type("Model", (), {lookup.REFERENCE_ATTRIBUTE: declared} if declared else {})
    assert lookup.find_reference("LlamaForCausalLM", cls).name == found


def test_a_subclass_of_another_architecture_gets_no_reference_from_its_base() -> None:
    import transformers

    class MyLlama(transformers.LlamaForCausalLM):  # its engine_ref class is nothing transformers names
        pass

    assert lookup.find_reference("MyLlamaForCausalLM", MyLlama) is None


@pytest.mark.parametrize("declared", ["NoSuchClassForCausalLM", "no_such_module:Model", "json:dumps", 3])
def test_a_declaration_that_does_not_resolve_names_the_value_and_the_fix(declared: Any) -> None:
    cls = type("Model", (), {lookup.REFERENCE_ATTRIBUTE: declared})
    with pytest.raises(lookup.ReferenceDeclarationError, match=rf"MyArch\.enginecheck_reference = {declared!r}.*: set "
                                                         rf"enginecheck_reference on MyArch's class"):
        lookup.find_reference("MyArch", cls)


def test_a_module_is_named_only_where_its_input_agrees_and_its_output_does_not() -> None:
    import torch

    x = torch.ones(3, 4)
    assert reference._agree([x], [x.clone()]) is True
    assert reference._agree([x * 2], [x]) is False
    assert reference._agree([torch.ones(3, 8)], [x]) is None  # not comparable (engine_ref's merged gate_up)
    hidden, residual = torch.randn(3, 4), torch.randn(3, 4)  # vLLM's residual-stream convention
    assert reference._agree(reference._readings([hidden, residual]), [hidden + residual]) is True
