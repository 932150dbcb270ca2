"""The checkpoint is fully accounted for (issue 31, item 5), through the ``pytest --enginecheck`` session over
zoo.reference_registry: each planted bug of zoo/planted_accounting.py fails load[tp=1], the loader's (a checkpoint
tensor load_weights never consumed) in the engine's own words, the checkpoint oracle's
(targets/engine_ref/checkpoint_values.py) as a ``checkpoint_mismatch`` naming the parameter, buffer or head; none
declares a reference implementation, so nothing else stands in their way. Each clean twin passes, its detail saying
what was compared and what was declared derived. Pure tests of the oracle's reassembly follow.
"""

from __future__ import annotations

import pytest

from pytest_enginecheck.targets.engine_ref import checkpoint_values
from tests.zoo_sessions import REFERENCE, ZooSession, zoo_session

ZOO_SESSIONS = {"accounting_session": "reference"}
ITEM = "load[tp=1]"
LOADER = "load_weights did not consume 1 checkpoint tensor(s): "
# planted arch -> (what its failure names in the message, the detail's "parameter": None for the loader's failures)
PLANTED: dict[str, tuple[str, str | None]] = {
    "BorrowedWeightAcctLlamaForCausalLM": (f"{LOADER}'model.layers.1.mlp.down_proj.weight' (model.safetensors)", None),
    "DroppedHeadAcctLlamaForCausalLM": (f"{LOADER}'lm_head.weight' (model.safetensors)", None),
    "OverwrittenNormAcctLlamaForCausalLM": (
        "parameter model.layers.1.post_attention_layernorm.weight differs from checkpoint tensor "
        "'model.layers.1.post_attention_layernorm.weight' (model.safetensors) in 64 of 64 elements",
        "model.layers.1.post_attention_layernorm.weight"),
    "ScaledKeyAcctLlamaForCausalLM": (  # only k's rows of the fused weight differ, and only k_proj is named
        "parameter model.layers.1.self_attn.qkv_proj.weight differs from checkpoint tensor "
        "'model.layers.1.self_attn.k_proj.weight' (model.safetensors) in 2048 of 8192 elements",
        "model.layers.1.self_attn.qkv_proj.weight"),
    "TiedHeadAcctLlamaForCausalLM": (
        "config.json says tie_word_embeddings=false, but lm_head shares model.embed_tokens's weight", "lm_head"),
    "UnloadedBufferAcctLlamaForCausalLM": (
        "buffer model.layers.1.mlp.out_scale is persistent (the state_dict holds it) but neither in the checkpoint",
        "model.layers.1.mlp.out_scale"),
}
DERIVED = "declared derived: its checkpoint name is in the weights_mapper's skip"
# twin arch -> (how lm_head is tied, what was not compared)
TWINS: dict[str, tuple[str, dict[str, str]]] = {
    "TiedAcctLlamaForCausalLM": ("tied, as config.json says", {}),
    "DerivedParamAcctLlamaForCausalLM": ("untied, as config.json says",
                                         {"model.layers.1.self_attn.rotary_emb.inv_freq": DERIVED}),
    "DerivedBufferAcctLlamaForCausalLM": ("untied, as config.json says", {"model.layers.1.mlp.out_scale": DERIVED}),
    "CleanRefLlamaForCausalLM": ("untied, as config.json says", {}),  # zoo/planted_reference.py's
}


@pytest.fixture(scope="module")
def accounting_session(tmp_path_factory: pytest.TempPathFactory) -> ZooSession:
    return zoo_session(tmp_path_factory, "reference", *REFERENCE)


def test_every_planted_accounting_bug_fails_load_naming_what_it_left_out(accounting_session: ZooSession) -> None:
    results = accounting_session.results
    assert {arch: results[(arch, ITEM)]["outcome"] for arch in PLANTED} == dict.fromkeys(PLANTED, "failed"), \
        accounting_session.stdout
    for arch, (named, parameter) in PLANTED.items():
        result = results[(arch, ITEM)]
        assert named in result["message"], result["message"]
        if parameter is None:  # the engine refused to load it: its WeightLoadError, with the fix
            assert result["detail"]["kind"] == "WeightLoadError"
            assert f"{arch} failed to start at tensor_parallel_size=1: {arch}.load_weights did not consume" in \
                result["message"]
            assert "declare it unused in the model's weights_mapper" in result["message"]
            continue
        assert result["message"].startswith(f"{arch} at tensor_parallel_size=1 does not hold what its checkpoint "
                                            f"holds (1 finding(s)): "), result["message"]
        detail = result["detail"]
        assert detail["kind"] == "checkpoint_mismatch" and detail["checkpoint_oracle"] == "checkpoint"
        assert detail["parameter"] == parameter and list(detail["checkpoint_findings"]) == [parameter]


def test_every_twin_passes_saying_what_it_compared(accounting_session: ZooSession) -> None:
    results = accounting_session.results
    assert {arch: results[(arch, ITEM)]["outcome"] for arch in TWINS} == dict.fromkeys(TWINS, "passed"), \
        accounting_session.stdout
    for arch, (tying, not_compared) in TWINS.items():
        detail = results[(arch, ITEM)]["detail"]
        assert detail["checkpoint_oracle"] == "checkpoint" and detail["oracle"] == "reference"
        assert detail["checkpoint_tying"] == {"lm_head": tying}
        assert detail["checkpoint_not_compared"] == not_compared
        # the 2-layer Llama's parameters (6 a layer, embedding, norm, an untied head), the derived ones left out
        assert detail["checkpoint_compared"] == 2 * 6 + 2 + tying.startswith("untied")


def test_the_reference_oracles_planted_bugs_still_fail_the_reference_first(accounting_session: ZooSession) -> None:
    """A bug both oracles see (zoo/planted_reference.py's overwritten norm and tied head) is the reference oracle's,
    which runs first: its failure and its oracle stand as test_reference_oracle expects."""
    results = accounting_session.results
    for arch in ("OverwrittenNormRefLlamaForCausalLM", "TiedHeadRefLlamaForCausalLM"):
        assert results[(arch, ITEM)]["detail"]["kind"] == "reference_mismatch"


def test_stacked_and_expert_parameters_are_reassembled_as_a_tp1_rank_loads_them() -> None:
    import torch
    from torch import nn

    from engine_ref.model_executor.model_loader.weight_utils import WeightsMapper, set_weight_attrs

    mapper = WeightsMapper(mapping=((".qkv_proj", ".q_proj", "q"), (".qkv_proj", ".k_proj", "k"),
                                    (".qkv_proj", ".v_proj", "v"), ("experts.w13", "experts.0.w1", (0, "gate")),
                                    ("experts.w13", "experts.0.w3", (0, "up")),
                                    ("experts.w13", "experts.1.w1", (1, "gate")),
                                    ("experts.w13", "experts.1.w3", (1, "up"))))
    tensors = {name: torch.randn(shape) for name, shape in [
        ("a.q_proj", (4, 3)), ("a.k_proj", (2, 3)), ("a.v_proj", (2, 3)), ("m.experts.0.w1", (2, 3)),
        ("m.experts.0.w3", (2, 3)), ("m.experts.1.w1", (2, 3)), ("m.experts.1.w3", (2, 3))]}
    qkv = nn.Parameter(torch.cat([tensors[f"a.{p}_proj"] for p in "qkv"]), requires_grad=False)
    set_weight_attrs(qkv, output_dim=0, checkpoint_shapes={"q": (4, 3), "k": (2, 3), "v": (2, 3)})
    rebuilt = checkpoint_values.reassemble(qkv, "a.qkv_proj", mapper, tensors)
    assert not isinstance(rebuilt, str), rebuilt
    value, parts = rebuilt
    assert torch.equal(value, qkv) and [p.name for p in parts] == ["a.q_proj", "a.k_proj", "a.v_proj"]
    assert torch.equal(value[parts[1].index], tensors["a.k_proj"])
    w13 = nn.Parameter(torch.stack([torch.cat([tensors[f"m.experts.{e}.w{i}"] for i in (1, 3)]) for e in (0, 1)]),
                       requires_grad=False)
    set_weight_attrs(w13, checkpoint_shapes={(e, w): (2, 3) for e in (0, 1) for w in ("gate", "up")})
    rebuilt = checkpoint_values.reassemble(w13, "m.experts.w13", mapper, tensors)
    assert not isinstance(rebuilt, str), rebuilt
    value, parts = rebuilt
    assert torch.equal(value, w13) and torch.equal(value[parts[3].index], tensors["m.experts.1.w3"])
    assert checkpoint_values.compare("parameter m.experts.w13", w13, value, parts, dict.fromkeys(tensors, "f")) is None
    w13.data[1, 2:].mul_(2)  # expert 1's up rows
    finding = checkpoint_values.compare("parameter m.experts.w13", w13, value, parts, dict.fromkeys(tensors, "f"))
    assert finding is not None and "checkpoint tensor 'm.experts.1.w3' (f) in 6 of 24 elements" in finding


def test_a_layout_the_oracle_cannot_rebuild_is_not_compared_and_says_why() -> None:
    import torch
    from torch import nn

    from engine_ref.model_executor.model_loader.weight_utils import WeightsMapper, set_weight_attrs

    mapper = WeightsMapper(mapping=((".gate_up_proj", ".gate_proj", 0), (".gate_up_proj", ".up_proj", 1)))
    tensors = {"a.gate_proj": torch.randn(2, 3), "a.up_proj": torch.randn(2, 3)}
    interleaved = nn.Parameter(torch.empty(4, 3), requires_grad=False)  # no output_dim: stacked how?
    set_weight_attrs(interleaved, checkpoint_shapes={0: (2, 3), 1: (2, 3)})
    assert checkpoint_values.reassemble(interleaved, "a.gate_up_proj", mapper, tensors) == \
        "2 checkpoint tensors and no output_dim to stack them along"
    assert checkpoint_values.reassemble(nn.Parameter(torch.empty(3)), "b.weight", mapper, tensors) == \
        "the checkpoint holds no 'b.weight'"
