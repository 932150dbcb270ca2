"""engine_ref's warm parent preloads torch and the engine core but not torch._dynamo (~1 s of CPU a process, paid by
every warm parent): engine startup never imports it, neither in the caller (the tiny checkpoint's meta-device build:
rotary frequencies, a vision tower's embeddings) nor in the workers (the real build, the profile run under
ActivationTracker, generate)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.helpers import SMALL_ENGINE

SCRIPT = """
import json, sys
from engine_ref import LLM
from engine_ref.model_executor.model_loader.checkpoint import make_checkpoint

make_checkpoint("LlavaForConditionalGeneration", sys.argv[1])
built = "torch._dynamo" in sys.modules
with LLM(sys.argv[1], tensor_parallel_size=2, **json.loads(sys.argv[2])) as llm:
    tokens = llm.generate([[1, 2, 3]], max_tokens=2)[0]
    workers = llm.engine.executor.collective_rpc(lambda worker: "torch._dynamo" in sys.modules)
print(json.dumps({"after checkpoint": built, "caller": "torch._dynamo" in sys.modules, "workers": workers,
                  "tokens": len(tokens)}))
"""


def test_engine_startup_imports_no_dynamo_in_the_caller_or_the_workers(tmp_path: Path) -> None:
    script = tmp_path / "start.py"
    script.write_text(SCRIPT)
    out = subprocess.run([sys.executable, str(script), str(tmp_path / "llava"), json.dumps(SMALL_ENGINE)],
                         capture_output=True, text=True, timeout=180,
                         env={**os.environ, "ENGINE_REF_WORKER_MULTIPROC_METHOD": "forkserver"})
    assert out.returncode == 0, out.stderr
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    assert seen == {"after checkpoint": False, "caller": False, "workers": [False, False], "tokens": 2}, seen
