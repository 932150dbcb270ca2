"""Diagnoses that say only what they proved (issue 32 item 4), through one ``pytest --enginecheck`` session over
zoo.proofs_registry (tests/plugin_zoo/zoo/planted_diagnosis2.py): each planted bug fails naming the place it was
planted (layer 1, compute_logits, the model's own output) and not the place a diagnosis that did not look there
blamed; each clean twin passes. Then the comparison on Captures built here, and the estimate's fake process group.

- noise only at TP=2, another each run: a second TP=2 run disagrees with the first, so it is nondeterminism at
  TP=2, not "a missing or extra collective";
- a wrong rank-1 shard of the logits: compute_logits is compared like a module, and named;
- noise on the model's output after its last submodule: the model's own output is compared, and named, instead of
  "the difference arises in decoding with the KV cache";
- a model that asks torch.distributed for its rank at TP>1 (unguarded, or only when a group exists): budget's
  estimate answers with the right rank under a fake process group, so both pass, rank 1 holding its own buffer.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist

from pytest_enginecheck.targets.engine_ref.tp_explain import Capture, explain_rerun, explain_tp
from tests.zoo_sessions import DIAGNOSIS_PROOFS, ZooSession, zoo_session

ZOO_SESSIONS = {"proofs": "diagnosis-proofs"}

TP_NOISE, TP_DROPOUT = "TpNoiseLlamaForCausalLM", "TpDropoutLlamaForCausalLM"
LOGITS, OWN_LOGITS = "LogitsShardLlamaForCausalLM", "OwnLogitsLlamaForCausalLM"
NOISY_OUT, ZERO_NOISE = "NoisyOutputLlamaForCausalLM", "ZeroNoiseOutputLlamaForCausalLM"
UNGUARDED, GUARDED = "UnguardedRankLlamaForCausalLM", "GuardedRankLlamaForCausalLM"
PASSING = {TP_DROPOUT: ("load[tp=1]", "load[tp=2]"), OWN_LOGITS: ("load[tp=1]", "load[tp=2]"),
           ZERO_NOISE: ("load[tp=1]", "load[tp=2]"), TP_NOISE: ("load[tp=1]",), LOGITS: ("load[tp=1]",),
           **{arch: ("load[tp=1]", "load[tp=2]", "budget[tp=1]", "budget[tp=2]") for arch in (UNGUARDED, GUARDED)}}
COLLECTIVE = "a missing or extra collective"
KV_CACHE = "arises in decoding with the KV cache"


@pytest.fixture(scope="module")
def proofs(tmp_path_factory: pytest.TempPathFactory) -> ZooSession:
    return zoo_session(tmp_path_factory, "diagnosis-proofs", *DIAGNOSIS_PROOFS)


def _result(session: ZooSession, arch: str, item: str) -> dict[str, Any]:
    return session.results[(arch, item)]


def test_every_clean_twin_passes(proofs: ZooSession) -> None:
    outcomes = {(arch, item): _result(proofs, arch, item)["outcome"] for arch, items in PASSING.items()
                for item in items}
    assert outcomes == dict.fromkeys(outcomes, "passed"), proofs.stdout
    assert len(proofs.results) == 16 + 4  # load of all 8, budget of the two that ask for their rank
    assert proofs.returncode == 1


def test_noise_only_at_tp2_is_nondeterminism_there_not_a_collective(proofs: ZooSession) -> None:
    result = _result(proofs, TP_NOISE, "load[tp=2]")
    message = result["message"]
    assert (result["outcome"], result["detail"]["kind"]) == ("failed", "nondeterministic"), message
    assert message.startswith(f"{TP_NOISE} is nondeterministic at tensor_parallel_size=2 only: "), message
    assert "two runs at tensor_parallel_size=2 of the same prompt under the same seed do not agree" in message
    assert ("The first module whose output changes between two runs at tensor_parallel_size=2 of the same prompt "
            "under the same seed is model.layers.1.mlp (TpNoiseMLP) on rank ") in message
    assert "it draws random numbers from a generator no seed reaches" in message
    assert result["detail"]["module"] == "model.layers.1.mlp"
    assert COLLECTIVE not in message and "weight_loader" not in message and "layers.0" not in message


def test_a_wrong_logits_shard_is_named_at_compute_logits(proofs: ZooSession) -> None:
    result = _result(proofs, LOGITS, "load[tp=2]")
    message = result["message"]
    assert (result["outcome"], result["detail"]["kind"]) == ("failed", "tp_mismatch"), message
    assert (f"The first module whose output differs between tensor_parallel_size=1 and 2 is "
            f"{LOGITS}.compute_logits (the logits): the LM head's weight shards reassemble to the TP=1 weight and the "
            f"model's output ({LOGITS}) agrees, but the logits do not") in message
    assert "compute_logits computes or gathers the ranks' vocabulary shards wrongly" in message
    assert COLLECTIVE not in message and "model.layers" not in message and "KV cache" not in message


def test_noise_on_the_models_own_output_is_named_there_not_in_decoding(proofs: ZooSession) -> None:
    result = _result(proofs, NOISY_OUT, "load[tp=1]")
    message = result["message"]
    assert (result["outcome"], result["detail"]["kind"]) == ("failed", "nondeterministic"), message
    assert message.startswith(f"{NOISY_OUT} is nondeterministic: Two runs at tensor_parallel_size=1 that differ "
                              f"only in the seed (0 and 1)"), message
    assert (f"The first module whose output changes between seeds 0 and 1 is {NOISY_OUT} (the model's own output, "
            f"after its last submodule)") in message
    assert result["detail"]["module"] == NOISY_OUT
    assert KV_CACHE not in message and "model.norm" not in message and "layers." not in message
    tp2 = _result(proofs, NOISY_OUT, "load[tp=2]")  # the same cause: folded into load[tp=1]
    assert (tp2["outcome"], tp2["message"]) == (
        "skipped", f"load[tp=1] failed, see enginecheck::{NOISY_OUT}::load[tp=1]"), tp2["message"]


@pytest.mark.parametrize("arch", [UNGUARDED, GUARDED])
def test_a_model_asking_for_its_rank_gets_the_estimate_of_that_rank(proofs: ZooSession, arch: str) -> None:
    """budget[tp=2] passes (the estimate equals the measurement), and rank 1's estimate holds its extra row."""
    result = _result(proofs, arch, "budget[tp=2]")
    assert result["outcome"] == "passed", result["message"]
    buffers = result["detail"]["estimate"]["buffer_bytes_per_rank"]
    assert buffers[1] - buffers[0] == 64 * 4  # one more float32 row of hidden_size 64: the rank it was told


# -- the comparison, on Captures built here -----------------------------------------------------------------------


def _run(*outputs: tuple[str, torch.Tensor], root: str | None = None, logits: str | None = None) -> Capture:
    c = Capture(root=root, logits=logits)
    for key, out in outputs:
        c.order.append(key)
        c.classes[key] = "Mod"
        c.outputs[key] = out
    return c


def test_a_rerun_that_agrees_exactly_proves_nothing_to_report() -> None:
    x = torch.ones(3, 8)
    ranks = [_run(("a", x), ("b", x)) for _ in range(2)]
    assert explain_rerun(ranks, [_run(("a", x.clone()), ("b", x.clone())) for _ in range(2)], 2) is None


def test_a_rerun_names_the_first_call_that_changes_on_any_rank() -> None:
    x = torch.ones(3, 8)
    first = [_run(("a", x), ("b", x), ("c", x)) for _ in range(2)]
    second = [_run(("a", x), ("b", x), ("c", x + 1)), _run(("a", x), ("b", x + 1e-7), ("c", x))]
    diagnosis = explain_rerun(first, second, 2)
    assert diagnosis is not None and diagnosis.nondeterministic and diagnosis.module == "b"
    assert "is b (Mod) on rank 1" in diagnosis.text


def test_the_kv_cache_is_blamed_only_when_the_logits_were_compared() -> None:
    x = torch.ones(3, 8)
    with_logits = explain_tp(_run(("a", x), ("M.compute_logits", x), logits="M.compute_logits"),
                             [_run(("a", x), ("M.compute_logits", x)) for _ in range(2)], 2)
    assert "its logits included: the tokens diverge in decoding with the KV cache" in with_logits.text
    without = explain_tp(_run(("a", x)), [_run(("a", x)) for _ in range(2)], 2)
    assert "but its logits were not compared: the tokens diverge in compute_logits or in decoding" in without.text


# -- the estimate's fake process group --------------------------------------------------------------------------


def test_the_fake_process_group_is_the_ranks_and_is_torn_down() -> None:
    from engine_ref.memory.fake_group import fake_process_group

    assert not dist.is_initialized()
    with fake_process_group(1, 2):
        assert (dist.get_rank(), dist.get_world_size()) == (1, 2)
    assert not dist.is_initialized()
    with pytest.raises(RuntimeError, match="the model failed"), fake_process_group(0, 2):
        raise RuntimeError("the model failed")
    assert not dist.is_initialized()
    with fake_process_group(0, 1):  # TP=1: the engine joins no process group, nor does the estimate
        assert not dist.is_initialized()
