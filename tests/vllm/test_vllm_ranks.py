"""vLLM's ranks at TP=2 under the engine's one deadline wait: a rank that hangs in its forward (its peer then waits
in the all-reduce) ends with both ranks' stacks in the failure, within the deadline and one grace; a rank that
dies is named with its exit."""

from __future__ import annotations

import time
from typing import Any

HANG_TIMEOUT_S = 60.0  # past a TP=2 start of the tiny Llama here, so the deadline finds rank 1 in its forward


def _rank1_breaks(how: str, workdir: str, timeout: float) -> tuple[str, str, float, list[str]]:
    """Register a Llama whose forward on rank 1 hangs or exits, start it at TP=2: (the EngineStartError's message,
    its phase, the seconds run_engine took, the shared-memory segments it left)."""
    import json
    import os
    from pathlib import Path

    from vllm import ModelRegistry
    from vllm.distributed import get_tensor_model_parallel_rank
    from vllm.model_executor.models.llama import LlamaForCausalLM

    from pytest_enginecheck.leaks import unowned_shm_entries
    from pytest_enginecheck.targets.vllm.checkpoints.tiny import make_tiny_checkpoint
    from pytest_enginecheck.targets.vllm.engine.drive import EngineStartError
    from pytest_enginecheck.targets.vllm.engine.run import run_engine

    class EctpRank1BreaksForCausalLM(LlamaForCausalLM):
        def forward(self, *args: Any, **kwargs: Any) -> Any:
            if get_tensor_model_parallel_rank() == 1:
                if how == "exit":
                    os._exit(3)
                rank1_hangs_in_its_forward()
            return super().forward(*args, **kwargs)

    def rank1_hangs_in_its_forward() -> None:
        time.sleep(3600)

    os.environ["VLLM_PLUGINS"] = "clean"  # not the plugin site's raising one, which every engine start would load
    ModelRegistry.register_model("EctpRank1BreaksForCausalLM", EctpRank1BreaksForCausalLM)
    ckpt = make_tiny_checkpoint("LlamaForCausalLM", Path(workdir) / "rank1-breaks")
    config = json.loads((ckpt / "config.json").read_text())
    (ckpt / "config.json").write_text(json.dumps({**config, "architectures": ["EctpRank1BreaksForCausalLM"]}))
    before = set(os.listdir("/dev/shm"))
    started = time.monotonic()
    try:
        run_engine(str(ckpt), 2, timeout=timeout)
    except EngineStartError as e:
        # vLLM's all-reduce segments and rank 0's shared-memory broadcast (a Python SharedMemory, psm_*), held by no
        # one: another engine's, which may start meanwhile, are held by its ranks
        new = (set(os.listdir("/dev/shm")) - before) & unowned_shm_entries(set())
        left = sorted(n for n in new if "cpushm" in n or n.startswith("psm_"))
        return str(e), e.failure.phase, time.monotonic() - started, left
    raise AssertionError("the engine started although rank 1's forward never returns")


def test_a_hung_rank_gives_every_pending_ranks_stacks_within_the_deadline_and_one_grace(in_child: Any,
                                                                                         tmp_path: Any) -> None:
    from pytest_enginecheck.targets.vllm.engine.ranks import SHUTDOWN_GRACE_S

    message, phase, seconds, left = in_child(_rank1_breaks, "hang", str(tmp_path), HANG_TIMEOUT_S, timeout=600.0)
    assert phase == "timeout", message
    assert message.startswith(f"rank 0, 1 did not finish within {HANG_TIMEOUT_S:g} s; their Python stacks"), message
    rank0, rank1 = message.split("\nrank 0:\n", 1)[1].split("\nrank 1:\n", 1)
    assert "rank1_hangs_in_its_forward" in rank1, rank1
    assert "rank1_hangs_in_its_forward" not in rank0 and "forward" in rank0, rank0  # waiting for rank 1 in forward
    assert HANG_TIMEOUT_S <= seconds < HANG_TIMEOUT_S + SHUTDOWN_GRACE_S, seconds
    # the killed ranks' all-reduce segments, which would fail the next TP=2 start (errno 17), and rank 0's broadcast,
    # which the resource tracker would report as leaked at the end of the run
    assert left == []


def test_a_rank_that_exits_is_named_with_its_exit_code(in_child: Any, tmp_path: Any) -> None:
    message, phase, seconds, left = in_child(_rank1_breaks, "exit", str(tmp_path), HANG_TIMEOUT_S, timeout=600.0)
    assert (message, phase) == ("rank 1 exited with code 3 before returning a result", "startup")
    # reported when it died, not at the deadline (the message says so too: a wait to the deadline reads "did not
    # finish"); how soon after the start depends on this machine's speed, so no tighter bound
    assert seconds < HANG_TIMEOUT_S, seconds
    assert left == []
