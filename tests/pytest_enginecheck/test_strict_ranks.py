"""--enginecheck-strict in every rank (targets/engine_ref/cuda_ranks.py, engine_ref/worker/cuda_guard.py) through two
``pytest --enginecheck`` sessions over zoo.strict_registry (load and startup, TP 1 and 2).

Strict: each planted CUDA access in layer 1 (zoo/planted_strict.py: a query and a `.cuda()` in every forward, a query
while built at TP > 1 only, a query in decode steps only) fails the first check that runs it as ``cuda_build`` or
``cuda_forward``, naming the rank of the engine that made it, the call, the file and the line, whichever executor
ran the rank (the uni executor's in the check process at TP=1, WorkerProcs at TP=2); the checks that meet it again
fold into that one, each having met it in its own ranks; the clean twin, which takes its device from its parameters,
passes. Without strict the queries pass (no false alarm), and the `.cuda()` fails as the CPU torch's AssertionError
names nothing of the model: what strict turns into a CUDA touch at its file and line.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from pytest_enginecheck import guard
from tests.zoo_sessions import LENIENT_RANKS, STRICT_RANKS, ZooSession, zoo_session

ZOO_SESSIONS = {"strict_session": "strict-ranks", "lenient_session": "lenient-ranks"}
PLANTED = Path(__file__).parents[1] / "plugin_zoo" / "zoo" / "planted_strict.py"
QUERY_FORWARD, DOT_CUDA = "QueryForwardStrictLlamaForCausalLM", "DotCudaForwardStrictLlamaForCausalLM"
QUERY_BUILD, DECODE, CLEAN = ("QueryBuildTPStrictLlamaForCausalLM", "DecodeQueryStrictLlamaForCausalLM",
                              "CleanStrictLlamaForCausalLM")
# arch -> (the item that fails, its kind, the call, init/query, the rank's phase, its PLANTED marker); the others fold
FAILS: dict[str, tuple[str, str, str, str, str, str]] = {
    QUERY_FORWARD: ("load[tp=1]", "cuda_forward", "torch.cuda.is_available", "query", "profile_run",
                    "PLANTED: query in forward"),
    DOT_CUDA: ("load[tp=1]", "cuda_forward", "Tensor.cuda", "init", "profile_run", "PLANTED: touch in forward"),
    QUERY_BUILD: ("load[tp=2]", "cuda_build", "torch.cuda.device_count", "query", "load_model",
                  "PLANTED: query at build, TP > 1 only"),
    DECODE: ("load[tp=1]", "cuda_forward", "torch.cuda.is_available", "query", "execute_model",
             "PLANTED: query in a decode step"),
}
ITEMS = ("load[tp=1]", "load[tp=2]", "budget[tp=1]", "budget[tp=2]", "startup")
LENIENT_ITEMS = ("load[tp=1]", "load[tp=2]", "startup")  # LENIENT_RANKS' checks


def planted_line(marker: str) -> int:
    return next(i for i, line in enumerate(PLANTED.read_text().splitlines(), 1) if marker in line)


@pytest.fixture(scope="module")
def strict_session(tmp_path_factory: pytest.TempPathFactory) -> ZooSession:
    return zoo_session(tmp_path_factory, "strict-ranks", *STRICT_RANKS)


@pytest.fixture(scope="module")
def lenient_session(tmp_path_factory: pytest.TempPathFactory) -> ZooSession:
    return zoo_session(tmp_path_factory, "lenient-ranks", *LENIENT_RANKS)


def test_each_planted_access_fails_the_first_check_that_meets_it_naming_rank_file_and_line(
        strict_session: ZooSession) -> None:
    results = strict_session.results
    for arch, (item, kind, api, access, phase, marker) in FAILS.items():
        result = results[(arch, item)]
        world_size = int(item[-2])
        rank = 1 if arch == QUERY_BUILD else 0  # the build query is planted on rank 1; a forward's first rank is 0
        assert (result["outcome"], result["detail"]["kind"]) == ("failed", kind), (arch, result["message"])
        detail = result["detail"]
        assert (detail["api"], detail["access"], detail["phase"], detail["rank"], detail["world_size"]) == \
            (api, access, phase, rank, world_size), arch
        assert (Path(detail["file"]).relative_to(strict_session.dir).as_posix(), detail["line"]) == \
            ("zoo/planted_strict.py", planted_line(marker)), arch
        what = f"called {api}() at " if access == "query" else f"initialized CUDA: {api} at "
        lead = "imports cleanly but" if kind == "cuda_build" else "builds cleanly but"
        assert result["message"].startswith(f"{arch} {lead} "), result["message"]
        assert f"{what}{detail['file']}:{detail['line']} (`" in result["message"]
        assert f"That was rank {rank} of {world_size}, in {phase}, under ENGINE_REF_CUDA_GUARD=strict" \
            in result["message"]
    assert strict_session.returncode == 1


def test_the_checks_that_meet_it_again_fold_into_it_each_in_its_own_ranks(strict_session: ZooSession) -> None:
    """Every other item of a planted model failed for the same cause and so reads as a skip naming the first (the
    budget check's requests too: the decode-step query meets its workload);
    each met the access in its own engine's ranks: the forwards at TP=2 in WorkerProc rank 0 (the lowest rank that
    failed a call), the build at TP=2 in rank 1, where it is planted."""
    results = strict_session.results
    for arch, (first, kind, _, _, phase, marker) in FAILS.items():
        for item in ITEMS[ITEMS.index(first) + 1:]:
            if (arch, item) == (QUERY_BUILD, "budget[tp=1]"):
                continue  # TP=1 never asks
            result = results[(arch, item)]
            detail = result["detail"]
            assert (result["outcome"], detail["kind"], detail["cause"]) == ("skipped", "dependency", kind), \
                (arch, item, result["message"])
            assert detail["root"] == f"enginecheck::{arch}::{first}"
            rank = 1 if arch == QUERY_BUILD else 0
            world_size = int(item[-2]) if "tp=" in item else 2  # startup runs at the largest TP size
            assert f"That was rank {rank} of {world_size}, in {phase}," in detail["failure"], (arch, item)
            assert f"zoo/planted_strict.py:{planted_line(marker)} (`" in detail["failure"]
    assert results[(QUERY_BUILD, "load[tp=1]")]["outcome"] == "passed"  # TP=1 never asks
    assert results[(QUERY_BUILD, "budget[tp=1]")]["outcome"] == "passed"


def test_the_clean_twin_passes_every_check_under_strict(strict_session: ZooSession) -> None:
    results = strict_session.results
    assert {item: results[(CLEAN, item)]["outcome"] for item in ITEMS} == dict.fromkeys(ITEMS, "passed"), \
        strict_session.stdout


def test_without_strict_the_queries_pass_and_dot_cuda_is_whatever_the_cpu_torch_raises(
        lenient_session: ZooSession) -> None:
    results = lenient_session.results
    for arch in (QUERY_FORWARD, QUERY_BUILD, DECODE):
        assert {item: results[(arch, item)]["outcome"] for item in LENIENT_ITEMS} == \
            dict.fromkeys(LENIENT_ITEMS, "passed"), (arch, lenient_session.stdout)
    dot_cuda = results[(DOT_CUDA, "load[tp=1]")]
    assert dot_cuda["outcome"] == "failed"
    assert dot_cuda["detail"]["kind"] not in ("cuda_build", "cuda_forward")
    assert "Torch not compiled with CUDA enabled" in dot_cuda["message"]
    assert lenient_session.returncode == 1


def test_the_engines_guard_replaces_what_the_checkers_guard_replaces() -> None:
    """engine_ref owns its guard (it never imports pytest_enginecheck): both must cover the same torch entry points,
    so a CPU machine reports in a rank what the checker reports at import."""
    import torch

    from engine_ref.worker import cuda_guard

    engines = {"_lazy_init", *cuda_guard.EARLY_FAILING_FUNCTIONS, *cuda_guard.EARLY_FAILING_CLASSES,
               *cuda_guard.QUERY_FUNCTIONS}
    assert {name for name in engines if getattr(torch.cuda, name, None) is not None} == \
        set(guard.guarded_originals())
