"""A real out-of-tree vLLM plugin distribution, written to a temporary site dir (dist-info with
entry_points.txt, as pip installs it): each entry point is one case the vLLM checks must judge."""

from __future__ import annotations

from pathlib import Path

DIST = "enginecheck-vllm-testplugins"
CUDA_PKG_DIST = "enginecheck-vllm-cudapkg"

ENTRY_POINTS = {
    "clean": "ectp.entry:register_clean",
    "cuda_chain": "ectp.entry:register_cuda_chain",
    "class_registered": "ectp.entry:register_class",
    "raising": "ectp.entry:register_raising",
    "bad_shard": "ectp.entry:register_bad_shard",
    "hungry": "ectp.entry:register_hungry",
}

_LLAMA = "from vllm.model_executor.models.llama import LlamaForCausalLM\n\n\n"

SOURCES = {
    "ectp/__init__.py": "",
    "ectp/entry.py": '''\
def register_clean():
    from vllm import ModelRegistry

    ModelRegistry.register_model("EctpCleanForCausalLM", "ectp.models.clean:EctpCleanForCausalLM")


def register_cuda_chain():
    from vllm import ModelRegistry

    ModelRegistry.register_model("EctpCudaForCausalLM", "ectp.models.cuda_model:EctpCudaForCausalLM")


def register_class():
    from vllm import ModelRegistry

    from ectp.models.class_registered import EctpClassForCausalLM

    ModelRegistry.register_model("EctpClassForCausalLM", EctpClassForCausalLM)


def register_raising():
    raise RuntimeError("ectp: the raising plugin cannot find its configuration")


def register_bad_shard():
    from vllm import ModelRegistry

    ModelRegistry.register_model("EctpBadShardForCausalLM", "ectp.models.bad_shard:EctpBadShardForCausalLM")


def register_hungry():
    from vllm import ModelRegistry

    ModelRegistry.register_model("EctpHungryForCausalLM", "ectp.models.hungry:EctpHungryForCausalLM")
''',
    "ectp/models/__init__.py": "",
    "ectp/models/clean.py": _LLAMA + "class EctpCleanForCausalLM(LlamaForCausalLM):\n    pass\n",
    "ectp/models/class_registered.py": _LLAMA + "class EctpClassForCausalLM(LlamaForCausalLM):\n    pass\n",
    "ectp/models/cuda_model.py": _LLAMA + "from ectp.models import cuda_helper  # noqa: F401\n\n\n"
                                 "class EctpCudaForCausalLM(LlamaForCausalLM):\n    pass\n",
    "ectp/models/cuda_helper.py": "import torch\n\nDEVICE_NAME = torch.cuda.get_device_name(0)\n",
    "ectp/models/bad_shard.py": _LLAMA + '''\
from vllm.distributed import get_tensor_model_parallel_world_size


def _without_rank_offset(name, weight):
    # The bug under test: every rank loads rank 0's input slice of the row-parallel o_proj.
    tp = get_tensor_model_parallel_world_size()
    if name.endswith("o_proj.weight") and tp > 1:
        return weight[:, : weight.shape[1] // tp].repeat(1, tp)
    return weight


class EctpBadShardForCausalLM(LlamaForCausalLM):
    def load_weights(self, weights):
        return super().load_weights((name, _without_rank_offset(name, w)) for name, w in weights)
''',
    "ectp/models/hungry.py": "import torch\n\n" + _LLAMA + '''\
class EctpHungryForCausalLM(LlamaForCausalLM):
    def __init__(self, *, vllm_config, prefix=""):
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        self.register_buffer("lookup_table", torch.zeros(8 * 1024 * 1024), persistent=False)  # 32 MiB
''',
    "ectp_cudapkg/__init__.py": "import torch\n\nHAS_GPU = torch.cuda.device_count() > 0\n\n\n"
                                "def register():\n    pass\n",
}


def _dist_info(site: Path, name: str, entry_points: dict[str, str]) -> None:
    info = site / f"{name.replace('-', '_')}-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 0.1\n")
    lines = "".join(f"{k} = {v}\n" for k, v in entry_points.items())
    (info / "entry_points.txt").write_text(f"[vllm.general_plugins]\n{lines}")


def write_plugin_site(site: Path) -> Path:
    """Write both test distributions (sources and dist-info) into ``site``; return it."""
    for relative, text in SOURCES.items():
        path = site / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    _dist_info(site, DIST, ENTRY_POINTS)
    _dist_info(site, CUDA_PKG_DIST, {"cudapkg": "ectp_cudapkg:register"})
    return site
