"""Real engine_ref plugin distributions, laid out in a site directory as ``pip install`` leaves them.

Two distributions: ``engine_ref_test_plugins`` (tests/data/engine_ref_test_plugins, one module per entry
point, each a case the plugins check must judge) and ``engine_ref_cudapkg``, a package whose ``__init__``
queries CUDA. A test puts the site on PYTHONPATH (and ENGINE_REF_PLUGINS picks the entry points).
"""

from __future__ import annotations

import shutil
from pathlib import Path

DATA = Path(__file__).parent / "data"
PACKAGE = "engine_ref_test_plugins"
CUDA_PKG = "engine_ref_cudapkg"
# In file order. "broken" raises, "cuda" initialises CUDA two imports below its module, "warm_only" fails
# only in a fresh interpreter, "half" registers HALF_ARCH and then raises.
ENTRY_POINTS = {"a": "plugin_a", "broken": "plugin_broken", "b": "plugin_b", "oot": "plugin_oot",
                "class": "plugin_class", "cuda": "plugin_cuda", "warm_only": "plugin_warm_only", "half": "plugin_half"}
OOT_ARCH = "OotLlamaForCausalLM"
HALF_ARCH = "HalfRegisteredLlamaForCausalLM"
CLASS_ARCH = "OotClassLlamaForCausalLM"


def _dist_info(site: Path, name: str, entry_points: dict[str, str]) -> None:
    info = site / f"{name}-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 0.1\n")
    lines = "".join(f"{k} = {v}\n" for k, v in entry_points.items())
    (info / "entry_points.txt").write_text(f"[engine_ref.general_plugins]\n{lines}")


def write_plugin_site(site: Path) -> Path:
    """Copy both packages into ``site`` with their dist-info; return ``site``."""
    for package in (PACKAGE, CUDA_PKG):
        shutil.copytree(DATA / package, site / package, ignore=shutil.ignore_patterns("__pycache__"))
    _dist_info(site, PACKAGE, {name: f"{PACKAGE}.{module}:register" for name, module in ENTRY_POINTS.items()})
    _dist_info(site, CUDA_PKG, {"cudapkg": f"{CUDA_PKG}:register"})
    return site
