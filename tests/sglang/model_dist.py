"""Real out-of-tree SGLang model packages, written to a temporary site dir as pip installs them (a dist-info with
``top_level.txt``): ``SGLANG_EXTERNAL_MODEL_PACKAGE`` names one, and SGLang's registry scans its modules.

``ecsg_models``, one module per case the checks must judge: ``clean`` (a Llama subclass SGLang can serve),
``cuda_model`` (its import reaches ``torch.cuda.init()`` through ``_impl.layer`` -> ``_impl.kernels``, a subpackage
SGLang's scan does not list), ``raising`` (raises at import, before its ``EntryClass``) and ``unservable`` (imports
cleanly, but has no ``load_weights``). ``ecsg_broken``: a package whose ``__init__`` raises, which makes SGLang's
registry itself fail to import.
"""

from __future__ import annotations

from pathlib import Path

DIST = "enginecheck-sglang-testmodels"
BROKEN_DIST = "enginecheck-sglang-broken"
PACKAGE = "ecsg_models"
BROKEN_PACKAGE = "ecsg_broken"
RAISING_MESSAGE = "ecsg: the raising model cannot find its kernel table"

SOURCES = {
    "ecsg_models/__init__.py": '"""Out-of-tree SGLang models for the sglang tier."""\n',
    "ecsg_models/clean.py": '''\
from sglang.srt.models.llama import LlamaForCausalLM


class EcsgCleanForCausalLM(LlamaForCausalLM):
    pass


EntryClass = EcsgCleanForCausalLM
''',
    "ecsg_models/cuda_model.py": '''\
from sglang.srt.models.llama import LlamaForCausalLM

from ecsg_models._impl.layer import FusedLayer


class EcsgCudaForCausalLM(LlamaForCausalLM):
    layer = FusedLayer


EntryClass = [EcsgCudaForCausalLM]
''',
    "ecsg_models/_impl/__init__.py": "",
    "ecsg_models/_impl/layer.py": '''\
from ecsg_models._impl.kernels import WORKSPACE


class FusedLayer:
    workspace = WORKSPACE
''',
    "ecsg_models/_impl/kernels.py": '''\
import torch

torch.cuda.init()  # at import: a check on a CPU machine must name this line
WORKSPACE = 1
''',
    "ecsg_models/raising.py": f'''\
from sglang.srt.models.llama import LlamaForCausalLM

raise RuntimeError({RAISING_MESSAGE!r})


class EcsgRaisingForCausalLM(LlamaForCausalLM):
    pass


EntryClass = EcsgRaisingForCausalLM
''',
    "ecsg_models/unservable.py": '''\
import torch


class EcsgUnservableForCausalLM(torch.nn.Module):
    def __init__(self, config, quant_config=None, prefix=""):
        super().__init__()

    def forward(self, input_ids, positions, forward_batch):
        return input_ids


EntryClass = EcsgUnservableForCausalLM
''',
    "ecsg_broken/__init__.py": 'raise ImportError("ecsg_broken: its __init__ cannot find its configuration")\n',
    "ecsg_broken/model.py": "class EcsgBrokenForCausalLM:\n    pass\n\n\nEntryClass = EcsgBrokenForCausalLM\n",
}


def _dist_info(site: Path, dist: str, package: str) -> None:
    info = site / f"{dist.replace('-', '_')}-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 0.1\n")
    (info / "top_level.txt").write_text(f"{package}\n")


def write_model_site(site: Path) -> Path:
    """Write both packages and their dist-infos into ``site``; return it."""
    for relative, source in SOURCES.items():
        path = site / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(source)
    _dist_info(site, DIST, PACKAGE)
    _dist_info(site, BROKEN_DIST, BROKEN_PACKAGE)
    return site
