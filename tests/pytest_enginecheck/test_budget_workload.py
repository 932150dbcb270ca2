"""budget[tp=N]'s workload (targets/engine_ref/workload.py) through one ``pytest --enginecheck`` session over
zoo.budget_registry: a decode-only scratch larger than the budget fails naming the decode steps, a per-forward leak
fails naming its size and every rank, at TP 1 and 2 (both planted in layer 1, invisible to startup's profile run);
each clean twin, which allocates in the same places, passes. Then the parts on their own: the step memory a worker
measures (engine_ref/memory/workload.py), and the sentences of pytest_enginecheck/budget.py.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import pytest
import torch

from engine_ref.engine.scheduler import ScheduledSequence, SchedulerOutput
from engine_ref.memory.workload import PhasePeak, StepMemoryTracker, WorkloadMemory
from engine_ref.utils import parse_size
from pytest_enginecheck.budget import per_request_leaks
from pytest_enginecheck.settings import BUDGET_MEMORY
from tests.zoo_sessions import BUDGET_WORKLOAD, ZooSession, zoo_session

ZOO_SESSIONS = {"budget_session": "budget-workload"}
MiB = 1 << 20
DECODE_SCRATCH, FITTING_SCRATCH, STEP_TENSOR = 768 * MiB, 64 * MiB, 4 * MiB  # as zoo/planted_budget.py allocates
TPS = (1, 2)
STEPS = 6  # a round: a prefill and 5 decode steps (workload.MAX_TOKENS = 6)
TWINS = ("FreedScratchLlamaForCausalLM", "StepScratchLlamaForCausalLM", "CachedWorkspaceLlamaForCausalLM")


@pytest.fixture(scope="module")
def budget_session(tmp_path_factory: pytest.TempPathFactory) -> ZooSession:
    return zoo_session(tmp_path_factory, "budget-workload", *BUDGET_WORKLOAD)


def test_the_planted_scratch_exceeds_the_default_budget_and_its_twin_fits() -> None:
    assert DECODE_SCRATCH > parse_size(BUDGET_MEMORY) > FITTING_SCRATCH


@pytest.mark.parametrize("tp", TPS)
def test_a_decode_only_scratch_over_the_budget_fails_naming_the_decode_steps(budget_session: ZooSession,
                                                                             tp: int) -> None:
    result = budget_session.results[("DecodeScratchLlamaForCausalLM", f"budget[tp={tp}]")]
    assert result["outcome"] == "failed", budget_session.stdout
    assert result["detail"]["kind"] == "workload"
    message = result["message"]
    assert message.startswith(f"DecodeScratchLlamaForCausalLM at tensor_parallel_size={tp} fits the budget at "
                              f"startup but not while serving requests: "), message
    for rank in range(tp):  # at TP=2 a rank may hold a collective's tensor gloo frees late (a KiB or so)
        assert re.search(rf"rank {rank} needs 768\.\d\d MiB in decode steps \(weights [\d.]+ KiB, activations "
                         rf"(?:767\.9\d|768\.\d\d) MiB where the profile run measured [\d.]+ MiB, "
                         rf"other [\d.]+ (?:B|KiB) held from earlier steps, KV [\d.]+ KiB for one request of "
                         rf"max_model_len 128, buffers \d+ B\) but the budget is 512\.00 MiB", message), message
        peaks, late = result["detail"]["workload_per_rank"][rank]["peaks"], result["detail"]["leak_tolerance"]
        # a held collective tensor gloo frees during the step lowers "activations" (peak - held at its start) by it
        assert peaks["decode"]["activations"] >= DECODE_SCRATCH - late
        assert peaks["prefill"]["activations"] < DECODE_SCRATCH
    assert "in prefill steps" not in message


@pytest.mark.parametrize("tp", TPS)
def test_a_per_forward_leak_fails_naming_its_size_and_every_rank(budget_session: ZooSession, tp: int) -> None:
    result = budget_session.results[("LeakyForwardLlamaForCausalLM", f"budget[tp={tp}]")]
    assert result["outcome"] == "failed", budget_session.stdout
    assert result["detail"]["kind"] == "per_request_leak"
    message = result["message"]
    assert message.startswith(f"LeakyForwardLlamaForCausalLM at tensor_parallel_size={tp} keeps memory from one "
                              f"request to the next: "), message
    for rank in range(tp):  # 6 steps of 4 MiB; at TP>1 a collective's buffer freed late may shift it by a few KiB
        found = re.search(rf"rank {rank} holds (\d+\.\d\d) MiB more after the second round than after the first "
                          rf"\(4\.00 MiB per step over its {STEPS} steps\), not KV cache", message)
        assert found is not None and abs(float(found.group(1)) - 24.0) <= 0.05, message


@pytest.mark.parametrize("tp", TPS)
@pytest.mark.parametrize("arch", TWINS)
def test_every_clean_twin_passes_having_allocated_where_its_bug_does(budget_session: ZooSession, arch: str,
                                                                     tp: int) -> None:
    result = budget_session.results[(arch, f"budget[tp={tp}]")]
    assert result["outcome"] == "passed", result["message"]
    detail = result["detail"]
    workload, held, late = detail["workload_per_rank"], detail["held_per_round"], detail["leak_tolerance"]
    assert len(workload) == tp and all(w["steps"] == 2 * STEPS for w in workload)
    assert (late == 0) == (tp == 1)  # at TP > 1 a collective's tensor may be freed late, inside the next step
    decode = [w["peaks"]["decode"]["activations"] for w in workload]
    prefill = [w["peaks"]["prefill"]["activations"] for w in workload]
    if arch == "FreedScratchLlamaForCausalLM":
        assert min(decode) >= FITTING_SCRATCH - late and all(0 <= h <= late for r in held for h in r)
    elif arch == "StepScratchLlamaForCausalLM":
        assert min(decode + prefill) >= STEP_TENSOR - late and all(0 <= h <= late for r in held for h in r)
    else:  # made at the first decode step, held after both rounds: no growth
        assert all(STEP_TENSOR <= h <= STEP_TENSOR + late for r in held for h in r)


def test_the_session_fails_exactly_the_planted_items(budget_session: ZooSession) -> None:
    failed = sorted(key for key, r in budget_session.results.items() if r["outcome"] == "failed")
    assert failed == [(arch, f"budget[tp={tp}]") for arch in ("DecodeScratchLlamaForCausalLM",
                                                              "LeakyForwardLlamaForCausalLM") for tp in TPS]
    assert budget_session.returncode == 1


def _step(n: int, start: int) -> SchedulerOutput:
    return SchedulerOutput([ScheduledSequence(0, [1] * n, start, [0])])


def test_a_step_is_a_decode_step_when_every_sequence_adds_one_token_to_its_cache() -> None:
    assert _step(5, 0).phase == "prefill"
    assert _step(1, 0).phase == "prefill"  # a one-token prompt
    assert _step(1, 5).phase == "decode"
    assert SchedulerOutput([*_step(1, 5).seqs, *_step(3, 0).seqs]).phase == "prefill"


def test_the_step_tracker_counts_per_phase_what_steps_allocate_and_what_they_keep() -> None:
    weights = torch.ones(1024)
    kept: list[torch.Tensor] = []
    tracker = StepMemoryTracker(torch.device("cpu"), [weights])

    def step(scratch: int, keep: int) -> None:
        workspace = torch.empty(scratch, dtype=torch.uint8)  # freed when the step returns
        kept.append(torch.empty(keep, dtype=torch.uint8))
        workspace.add_(1)
        weights.add_(1)  # in place, on a tensor that is not the step's: not counted

    tracker.step("prefill", lambda: step(4096, 0))
    tracker.step("decode", lambda: step(1000, 100))
    tracker.step("decode", lambda: step(10, 100))  # 100 held + 110: below the first decode step's peak
    report = tracker.report()
    assert report.peaks == {"prefill": PhasePeak(4096, 0, 1), "decode": PhasePeak(1100, 0, 2)}
    assert report.held == 200 and report.steps == 3
    kept.clear()
    assert tracker.report().held == 0
    with pytest.raises(ValueError, match="unknown step phase 'profile'; use one of prefill, decode"):
        tracker.step("profile", lambda: None)


@dataclass
class _Report:
    rank: int
    workload: WorkloadMemory


def test_growth_is_a_leak_only_past_the_tolerance() -> None:
    first = [_Report(0, WorkloadMemory({}, held=100)), _Report(1, WorkloadMemory({}, held=100))]
    second = [_Report(0, WorkloadMemory({"decode": PhasePeak(steps=6)}, held=100 + 6 * MiB)),
              _Report(1, WorkloadMemory({"decode": PhasePeak(steps=6)}, held=100 + 4096))]
    assert per_request_leaks(first, second, tolerance=4096) == [
        "rank 0 holds 6.00 MiB more after the second round than after the first (1.00 MiB per step over its 6 "
        "steps), not KV cache"]
    assert len(per_request_leaks(first, second)) == 2
