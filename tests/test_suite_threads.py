"""The suite's processes run one intra-op thread each unless the caller chose a number: the root conftest sets
OMP_NUM_THREADS before torch loads, and every process the suite starts inherits it."""

from __future__ import annotations

import os
import subprocess
import sys


def test_workers_and_the_processes_they_start_run_the_configured_intra_op_threads() -> None:
    import torch

    assert "OMP_NUM_THREADS" in os.environ, "the root conftest sets it (1) where the caller did not"
    threads = int(os.environ["OMP_NUM_THREADS"])
    child = subprocess.run([sys.executable, "-c", "import torch; print(torch.get_num_threads())"],
                           capture_output=True, text=True, timeout=120, check=True)
    assert (torch.get_num_threads(), int(child.stdout)) == (threads, threads)
