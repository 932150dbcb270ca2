"""Every planted bug of ``zoo.planted`` through one ``pytest --enginecheck`` session: each is caught by the check
meant to catch it (and by no other), a check that fails for the same cause is folded into its root, and the clean
twin passes every check. The whole verdict grid is asserted, so a false pass and a false alarm both fail here.

lora is left out of this session (the bundled zoo's lora run and zoo.lora_models cover it); quant runs int8. The
session is shared with test_determinism and test_folding (tests/zoo_sessions.py).
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.helpers import zoo_loader
from tests.zoo_sessions import PLANTED, zoo_session

# the fixture that reads a shared zoo session -> its name (started early: tests/zoo_sessions.py)
ZOO_SESSIONS = {"planted": "planted"}

CHECKS = "import,inspect,load,budget,startup,quant"
ITEMS = ["import", "inspect", "load[tp=1]", "load[tp=2]", "budget[tp=1]", "budget[tp=2]", "startup",
         "quant[int8,tp=1]", "quant[int8,tp=2]"]

# arch -> the items that do not pass: item -> (outcome, the start of its message)
EXPECTED: dict[str, dict[str, tuple[str, str]]] = {
    "CleanTwinLlamaForCausalLM": {},
    "RngMLPLlamaForCausalLM": {
        "load[tp=1]": ("failed", "RngMLPLlamaForCausalLM is nondeterministic: Two runs at tensor_parallel_size=1 "
                                 "that differ only in the seed (0 and 1) generate different tokens"),
        "load[tp=2]": ("skipped", "load[tp=1] failed, see enginecheck::RngMLPLlamaForCausalLM::load[tp=1]"),
    },
    "PollerThreadLlamaForCausalLM": {  # every engine leaves the thread running: the first to shut down tells
        "load[tp=1]": ("failed", "PollerThreadLlamaForCausalLM started at tensor_parallel_size=1, but did not shut "
                                 "down cleanly: rank 0 (pid "),
        **{item: ("skipped", "load[tp=1] failed, see enginecheck::PollerThreadLlamaForCausalLM::load[tp=1]")
           for item in ("load[tp=2]", "budget[tp=1]", "budget[tp=2]", "startup", "quant[int8,tp=1]",
                        "quant[int8,tp=2]")},
    },
    "QuantScaleLlamaForCausalLM": {
        "quant[int8,tp=1]": ("failed", "The int8 logits of QuantScaleLlamaForCausalLM (converted_tp1) are not "
                                       "those of the unquantized engine loaded with the dequantized weights deq(W)"),
        "quant[int8,tp=2]": ("failed", "The int8 logits of QuantScaleLlamaForCausalLM (converted_tp1) are not "
                                       "those of the unquantized engine loaded with the dequantized weights deq(W)"),
    },
    "PaddedActLlamaForCausalLM": {
        "load[tp=2]": ("failed", "At tensor_parallel_size=2, PaddedActLlamaForCausalLM generates different tokens "
                                 "than at tensor_parallel_size=1"),
        "quant[int8,tp=2]": ("skipped", "load[tp=2] failed, see enginecheck::PaddedActLlamaForCausalLM::load[tp=2]"),
    },
    "ShardAndLeakLlamaForCausalLM": {  # the leak, from every engine, and beside it the sharding at TP=2
        "load[tp=1]": ("failed", "ShardAndLeakLlamaForCausalLM started and shut down at tensor_parallel_size=1, but "
                                 "left behind: child processes ["),
        "load[tp=2]": ("failed", "At tensor_parallel_size=2, ShardAndLeakLlamaForCausalLM generates different "
                                 "tokens than at tensor_parallel_size=1"),
        **{item: ("skipped", "load[tp=1] failed, see enginecheck::ShardAndLeakLlamaForCausalLM::load[tp=1]")
           for item in ("budget[tp=1]", "budget[tp=2]", "startup", "quant[int8,tp=1]")},
        "quant[int8,tp=2]": ("skipped",
                             "load[tp=2] failed, see enginecheck::ShardAndLeakLlamaForCausalLM::load[tp=2]"),
    },
    "ScaledShardLlamaForCausalLM": {  # every greedy token stays; the hidden states do not
        "load[tp=2]": ("failed", "At tensor_parallel_size=2, ScaledShardLlamaForCausalLM generates the same greedy "
                                 "tokens as at tensor_parallel_size=1, but other hidden states"),
        # quant's TP=2 oracle (the unquantized engine on deq(W) at TP=2) inherits the bug: it is load[tp=2]'s
        "quant[int8,tp=2]": ("skipped", "load[tp=2] failed, see enginecheck::ScaledShardLlamaForCausalLM::load[tp=2]"),
    },
    "DecodePositionsLlamaForCausalLM": {  # the same bug at TP=2 and in the quantized runs: only TP=1's KV run tells
        "load[tp=1]": ("failed", "DecodePositionsLlamaForCausalLM generates different tokens with the KV cache than "
                                 "recomputing without it, at tensor_parallel_size=1: for prompt "),
    },
}


@pytest.fixture(scope="module")
def planted(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, dict[tuple[str, str], dict[str, Any]]]:
    """One serial ``pytest --enginecheck`` run over zoo.planted: its output and its results by (arch, item)."""
    assert f"--enginecheck-checks={CHECKS}" in PLANTED and "--enginecheck-quant=int8" in PLANTED
    session = zoo_session(tmp_path_factory, "planted", *PLANTED)
    return session.stdout, session.results


def test_the_verdict_grid_is_exactly_the_planted_bugs(planted: tuple[str, dict]) -> None:
    stdout, results = planted
    grid = {arch: {item: results[(arch, item)]["outcome"] for item in ITEMS} for arch in EXPECTED}
    assert grid == {arch: {item: bad.get(item, ("passed", ""))[0] for item in ITEMS}
                    for arch, bad in EXPECTED.items()}, stdout
    for arch, bad in EXPECTED.items():
        for item, (_, start) in bad.items():
            assert results[(arch, item)]["message"].startswith(start), results[(arch, item)]["message"]
    assert len(results) == len(EXPECTED) * len(ITEMS)


def test_each_bug_is_named_where_it_was_planted(planted: tuple[str, dict]) -> None:
    """Layer 1, not layer 0, and not a later module: the messages name the planted module."""
    results = planted[1]
    rng = results[("RngMLPLlamaForCausalLM", "load[tp=1]")]
    assert "The first module whose output changes between seeds 0 and 1 is model.layers.1.mlp (NoisyMLP)" \
        in rng["message"]
    assert rng["detail"]["kind"] == "nondeterministic"
    padded = results[("PaddedActLlamaForCausalLM", "load[tp=2]")]["message"]
    assert ("The first module that could not be compared between tensor_parallel_size=1 and 2 is "
            "model.layers.1.mlp.act_fn (PaddedSiluAndMul)") in padded
    shard = results[("ShardAndLeakLlamaForCausalLM", "load[tp=2]")]["message"]
    assert "The first module whose output differs between tensor_parallel_size=1 and 2 is " \
           "model.layers.1.mlp.down_proj (MirroredRowParallelLinear)" in shard
    # the bug is in that layer's own weight_loader (zoo/engine_models.py): the diagnosis names it, file and line
    assert f"a sharding bug in its weight_loader: its parameters were loaded by " \
           f"{zoo_loader('MirroredRowParallelLinear.weight_loader')}." in shard
    quant = results[("QuantScaleLlamaForCausalLM", "quant[int8,tp=2]")]["message"]
    assert "model.layers.1.mlp.down_proj.weight (rank 0: relative error 0.05, 1.05x deq(W))" in quant
    poller = results[("PollerThreadLlamaForCausalLM", "load[tp=1]")]
    assert "non-daemon thread 'kv-stats-poller-1' (target zoo.planted_thread.poll_kv_stats)" in poller["message"]
    assert poller["detail"]["kind"] == "unclean_shutdown"
    # startup failed for it too (at TP=2, its workers needed SIGTERM), folded into load[tp=1] with its words kept
    startup = results[("PollerThreadLlamaForCausalLM", "startup")]["detail"]
    assert (startup["kind"], startup["cause"]) == ("dependency", "unclean_shutdown")
    assert startup["failure"].startswith("PollerThreadLlamaForCausalLM started at tensor_parallel_size=2, but did not "
                                         "shut down cleanly: rank 0 (pid ")
    assert "needed SIGTERM" in startup["failure"] and "'kv-stats-poller-1'" in startup["failure"]


def test_an_independent_failure_is_not_folded(planted: tuple[str, dict]) -> None:
    """The sharding bug has nothing to do with the leak: load[tp=2] fails for it and says its root (load[tp=1], failed
    for the leak) failed too; what its own engines left is added, not put first."""
    load = planted[1][("ShardAndLeakLlamaForCausalLM", "load[tp=2]")]
    assert load["message"].endswith(
        "\n(load[tp=1] failed too, see enginecheck::ShardAndLeakLlamaForCausalLM::load[tp=1].)")
    assert ("\nIt also left things behind: ShardAndLeakLlamaForCausalLM started and shut down at "
            "tensor_parallel_size=2, but left behind: child processes [") in load["message"]
    assert (load["detail"]["kind"], load["detail"]["cause"]) == ("tp_mismatch", "tp_mismatch")
    assert planted[1][("ShardAndLeakLlamaForCausalLM", "load[tp=1]")]["detail"]["cause"] == "leak"
    folded = planted[1][("ShardAndLeakLlamaForCausalLM", "quant[int8,tp=2]")]
    assert folded["detail"]["kind"] == "dependency"
