"""What a vLLM model author reads from a real run: the check's own message first, vLLM's log trimmed in the captured
section, the token lists labelled by TP size, and no multiprocessing semaphore leaked by the check children."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path


def test_a_tp_bug_reads_as_the_checks_message_with_a_trimmed_log_and_leaks_no_semaphore(plugin_site: Path,
                                                                                         tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(plugin_site), os.environ.get("PYTHONPATH")])),
           "VLLM_PLUGINS": "bad_shard"}
    env.pop("ENGINECHECK_VLLM_LOG", None)
    env.pop("ENGINECHECK_FULL_OUTPUT", None)
    run = subprocess.run([sys.executable, "-m", "pytest", "--enginecheck", "--enginecheck-target=vllm", "-m",
                          "enginecheck", "--enginecheck-checks=load", "--enginecheck-tp=2", "-k",
                          "EctpBadShardForCausalLM", "-p", "no:cacheprovider"],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    output = run.stdout + run.stderr
    assert run.returncode == 1, output
    header = output.index("enginecheck EctpBadShardForCausalLM load[tp=2]")
    message = output.index("EctpBadShardForCausalLM at tensor_parallel_size=2 generates other greedy tokens", header)
    assert message < output.index("Captured stderr call", header), output
    assert "(TP=2: [" in output and ", TP=1: [" in output, output
    assert "Chat template warmup failed" not in output, output
    assert " INFO " not in output[message:], output  # vLLM's INFO records are not about a token mismatch
    assert "left out; ENGINECHECK_FULL_OUTPUT=1 shows them" in output, output
    assert "% Completed |" not in output, output  # vLLM's safetensors progress bar (pytest_enginecheck/output.py)
    # The tiny checkpoint's save_pretrained used to create tqdm's RLock in the (forkserver) check child, which leaves
    # by os._exit: its named semaphore was never unlinked.
    assert "leaked semaphore" not in output, output
