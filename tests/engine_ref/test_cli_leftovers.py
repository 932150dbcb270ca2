"""``engine-ref startup ARCH`` killed with SIGKILL mid-run leaves nothing after the next start: the tiny checkpoint it
writes is inside its owner directory (engine_ref.isolation.tempdirs), which the next start's sweep removes.

Real processes and a real SIGKILL in a private TMPDIR, as in test_leftovers.py (whose helpers this uses): the CLI
starts a TP=2 engine whose rank 1 hangs before READY, so it is surely mid-run when it is killed. The next start is
its first step, ``sweep`` (test_leftovers.py runs whole next starts).
"""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

from engine_ref.isolation.tempdirs import PREFIX, sweep
from tests.engine_ref.test_leftovers import REPO, kill, ours, popen, tmp, wait_until  # noqa: F401 - tmp: a fixture
from tests.fault_models import FAULT_ARCH

CLI_SCRIPT = """
import sys
sys.path.insert(0, {repo!r})
from engine_ref.entrypoints.cli import main
from tests import fault_models
from tests.fault_models import fault_overrides

faulty = fault_models.FaultyLlamaForCausalLM  # the CLI's tiny checkpoint: rank 1 hangs before READY
faulty.example_config = {{**faulty.example_config, **fault_overrides("hang", "init")}}
with fault_models.registered() as arch:
    sys.exit(main(["startup", arch, "--tensor-parallel-size", "2", "--device-memory", "64MiB",
                   "--max-model-len", "64", "--max-num-batched-tokens", "64"]))
"""


def test_a_killed_cli_startup_leaves_nothing_after_the_next_start(
        tmp: Path, procs: list[subprocess.Popen[str]]) -> None:  # noqa: F811 - tmp: the fixture
    script = tmp.parent / f"{tmp.name}-cli.py"
    script.write_text(CLI_SCRIPT.format(repo=str(REPO)))
    try:
        proc = popen([sys.executable, str(script)], tmp, procs)
        owned = f"{PREFIX}{proc.pid}-*"
        wait_until(lambda: bool(list(tmp.glob(f"{owned}/startup-*/{FAULT_ARCH}/config.json"))
                                and list(tmp.glob(f"{owned}/mp-*/store"))), 120,
                   "the CLI's tiny checkpoint and its engine's rendezvous store")
        kill(proc, signal.SIGKILL)
        assert proc.returncode == -signal.SIGKILL, "killed mid-run, not finished"
        left = ours(tmp)
        assert [name.split("-")[:2] for name in left] == [["engine_ref", str(proc.pid)]], (
            f"every temp entry of the CLI is inside its one owner directory: {left}")
        assert [Path(path).name for path in sweep(str(tmp))] == left
        assert ours(tmp) == []
    finally:
        script.unlink()
