"""What several test modules share: the bundled architectures, small engine settings, the
process and checkpoint helpers the leak and sharding tests use, and an engine_ref plugin
distribution. Test modules import from here, never from each other."""

from __future__ import annotations

import math
import textwrap
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

ARCHITECTURES = [
    "LlamaForCausalLM",
    "Qwen2ForCausalLM",
    "MixtralForCausalLM",
    "Qwen3MoeForCausalLM",
    "LlavaForConditionalGeneration",
]
LLAMA = "LlamaForCausalLM"
# A minimal model class: what ModelInfo.from_model_cls needs, and nothing heavy to import.
TINY_MODEL_CLASS = '''
class TinyModel:
    example_config = {"architectures": ["TinyModel"]}

    def forward(self, input_ids, positions):
        return input_ids

    def compute_logits(self, hidden_states):
        return hidden_states

    def load_weights(self, weights):
        return set()
'''
# A tiny-Llama engine that starts in milliseconds: a small simulated device and short sequences.
SMALL_ENGINE: dict[str, Any] = {"device_memory": "64MiB", "max_model_len": 64, "max_num_batched_tokens": 64}
# At TP=2 a rank holds half of every sharded tensor plus every replicated one (norms, routers,
# biases of row-parallel layers, Llava's projector): a few percent over half.
MAX_SHARE_READ_AT_TP2 = 0.55


def checkpoint_bytes(model: Path) -> int:
    """Bytes of tensor data in the checkpoint's safetensors files, each tensor at its stored dtype."""
    from safetensors import safe_open

    total = 0
    for path in model.glob("*.safetensors"):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                tensor = f.get_slice(name)
                total += math.prod(tensor.get_shape()) * _itemsize(tensor.get_dtype())
    return total


# Bytes per element of the dtypes a safetensors header names.
_ITEMSIZE = {"F64": 8, "I64": 8, "F32": 4, "I32": 4, "F16": 2, "BF16": 2, "I16": 2,
             "F8_E4M3": 1, "F8_E5M2": 1, "I8": 1, "U8": 1, "BOOL": 1}


def _itemsize(safetensors_dtype: str) -> int:
    return _ITEMSIZE[safetensors_dtype]


def gone(pid: int) -> bool:
    """The process no longer runs (a zombie waiting for a parent that is not us counts as gone)."""
    import psutil

    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def alive(pid: int, cmdline_part: str = "") -> bool:
    """The process runs (not a zombie), with ``cmdline_part`` in its command line if one is given."""
    import psutil

    if gone(pid):
        return False
    try:
        return cmdline_part in " ".join(psutil.Process(pid).cmdline())
    except psutil.NoSuchProcess:
        return False


def wait_gone(pids: Iterable[int], timeout: float) -> list[int]:
    """The pids still running after ``timeout`` seconds (returns as soon as all are gone)."""
    pids = list(pids)
    deadline = time.monotonic() + timeout
    while True:
        alive = [pid for pid in pids if not gone(pid)]
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.02)


def zoo_loader(qualname: str, module: str = "engine_models") -> str:
    """How a TP diagnosis names a weight loader of tests/plugin_zoo/zoo/``module``.py, run from a copy of the zoo:
    ``Class.weight_loader (zoo/engine_models.py:LINE)``, the line of its ``def``."""
    path = Path(__file__).parent / "plugin_zoo" / "zoo" / f"{module}.py"
    classname, function = qualname.rsplit(".", 1)
    lines = path.read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(f"class {classname}("))
    line = next(i for i, line in enumerate(lines) if i > start and line.strip().startswith(f"def {function}(")) + 1
    return f"{qualname} (zoo/{module}.py:{line})"


def install_engine_ref_plugin(site: Path, module: str, entry_point: str, body: str) -> Path:
    """Write plugin ``module`` (its ``register()`` runs ``body``) and its dist-info (entry point ``entry_point``)
    into ``site``; returns ``site``."""
    (site / f"{module}.py").write_text("def register():\n" + textwrap.indent(textwrap.dedent(body).strip(), "    ")
                                       + "\n")
    dist_info = site / f"{module}-1.0.dist-info"
    dist_info.mkdir()
    (dist_info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {module}\nVersion: 1.0\n")
    (dist_info / "entry_points.txt").write_text(f"[engine_ref.general_plugins]\n{entry_point} = {module}:register\n")
    return site
