"""The load check's TP diagnosis through ``pytest --enginecheck``: each of three TP bugs (tests/plugin_zoo/zoo
tp_models.py, engine_models.py) is named at its layer with its kind: a weight sharded wrongly (with the weight_loader
that loaded it), a missing collective, a row-parallel layer declared column-parallel."""

from __future__ import annotations

import pytest

from tests.helpers import zoo_loader
from tests.zoo_sessions import TP_DIAGNOSIS, zoo_session

# the fixture that reads a shared zoo session -> its name (started early: tests/zoo_sessions.py)
ZOO_SESSIONS = {"load_results": "tp-diagnosis"}


@pytest.fixture(scope="module")
def load_results(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, dict[str, dict]]:
    """The ``pytest --enginecheck`` run of the load and startup checks over the TP zoo (shared, started early:
    tests/zoo_sessions.py; it starts a dozen engines and diagnoses three): its output, and its load[tp=2] results
    by architecture and startup results by ``arch::startup``."""
    session = zoo_session(tmp_path_factory, "tp-diagnosis", *TP_DIAGNOSIS)
    return session.stdout, {r["arch"] if r["check"] == "load[tp=2]" else f"{r['arch']}::{r['check']}": r
                            for r in session.report["results"] if r["check"] in ("load[tp=2]", "startup")}


def test_every_tp1_load_passes_and_every_tp2_fails(load_results: tuple[str, dict[str, dict]]) -> None:
    stdout, tp2 = load_results
    archs = ["BadShardLlamaForCausalLM", "RowAsColumnLlamaForCausalLM", "NoAllReduceLlamaForCausalLM"]
    assert {arch: tp2[arch]["outcome"] for arch in archs} == dict.fromkeys(archs, "failed")
    assert "3 failed" in stdout, stdout


def test_a_build_failing_only_at_tp2_fails_once(load_results: tuple[str, dict[str, dict]]) -> None:
    """startup runs at TP=2 and fails for the same reason: it names load[tp=2] instead of repeating it."""
    startup = load_results[1]["RowAsColumnLlamaForCausalLM::startup"]
    assert (startup["outcome"], startup["message"]) == (
        "skipped", "load[tp=2] failed, see enginecheck::RowAsColumnLlamaForCausalLM::load[tp=2]")


def test_a_mis_sharded_weight_is_named_with_the_columns_it_holds(load_results: tuple[str, dict[str, dict]]) -> None:
    message = load_results[1]["BadShardLlamaForCausalLM"]["message"]
    assert message.startswith("At tensor_parallel_size=2, BadShardLlamaForCausalLM generates different tokens")
    assert ("The first module whose output differs between tensor_parallel_size=1 and 2 is "
            "model.layers.0.mlp.down_proj (MirroredRowParallelLinear): its weights do not reassemble to the TP=1 "
            "weights (rank 0's weight holds input columns 64:128 of the TP=1 weight, not its own 0:64): a sharding "
            "bug in its weight_loader: its parameters were loaded by "
            f"{zoo_loader('MirroredRowParallelLinear.weight_loader')}.") in message


def test_a_missing_all_reduce_reads_as_a_collective_bug(load_results: tuple[str, dict[str, dict]]) -> None:
    message = load_results[1]["NoAllReduceLlamaForCausalLM"]["message"]
    assert ("is model.layers.0.self_attn.o_proj (RowParallelLinear): its weights reassemble to the TP=1 weights, "
            "but its output does not") in message
    assert "a missing or extra collective" in message


def test_a_row_parallel_layer_declared_column_parallel_reads_as_that(
        load_results: tuple[str, dict[str, dict]]) -> None:
    result = load_results[1]["RowAsColumnLlamaForCausalLM"]
    assert result["message"] == (
        "RowAsColumnLlamaForCausalLM fails to start at tensor_parallel_size=2: model.layers.0.self_attn.o_proj is "
        "declared column-parallel (ColumnParallelLinear), but its input arrives sharded (width 32 of 64 on each "
        "rank, the output of a column-parallel layer before it): a layer whose input is sharded is row-parallel. "
        "Make model.layers.0.self_attn.o_proj a RowParallelLinear.")
    assert "Traceback" not in load_results[0] and "mat1 and mat2" not in load_results[0]  # not the shape error
