"""General plugins, through a real installed entry point.

A tiny distribution (tests/data/engine_ref_test_plugins plus a ``*.dist-info`` declaring the
``engine_ref.general_plugins`` entry points) is laid out in a temporary site directory, and each
check runs in a fresh interpreter with that directory on PYTHONPATH: plugins load once per process,
so only a new process shows what loading does.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import ARCHITECTURES

PACKAGE = "engine_ref_test_plugins"
PACKAGE_SOURCE = Path(__file__).parent / "data" / PACKAGE
# In file order; "broken" raises, and the plugins after it must still load.
ENTRY_POINTS = {"a": "plugin_a", "broken": "plugin_broken", "b": "plugin_b", "oot": "plugin_oot"}
WORKING = ["a", "b", "oot"]
OOT_ARCH = "OotLlamaForCausalLM"


@pytest.fixture(scope="module")
def site_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A site directory holding the package and its dist-info, as ``pip install`` would leave them."""
    site = tmp_path_factory.mktemp("site")
    shutil.copytree(PACKAGE_SOURCE, site / PACKAGE, ignore=shutil.ignore_patterns("__pycache__"))
    dist_info = site / f"{PACKAGE}-0.1.dist-info"
    dist_info.mkdir()
    (dist_info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {PACKAGE}\nVersion: 0.1\n")
    lines = [f"{name} = {PACKAGE}.{module}:register" for name, module in ENTRY_POINTS.items()]
    (dist_info / "entry_points.txt").write_text("[engine_ref.general_plugins]\n" + "\n".join(lines) + "\n")
    return site


def run_python(script: str, site: Path, plugins: str | None = None, timeout: float = 120) -> tuple[Any, str]:
    """Run ``script`` in a fresh interpreter that sees the site dir; return (its last stdout line as JSON, stderr).

    ``plugins`` is ENGINE_REF_PLUGINS (None: unset).
    """
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(site), env.get("PYTHONPATH")]))
    env.pop("ENGINE_REF_PLUGINS", None)
    if plugins is not None:
        env["ENGINE_REF_PLUGINS"] = plugins
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(script)], env=env, capture_output=True,
                         text=True, timeout=timeout)
    assert out.returncode == 0, f"stdout:\n{out.stdout}\nstderr:\n{out.stderr}"
    return json.loads(out.stdout.strip().splitlines()[-1]), out.stderr


LOAD_TWICE = f"""
    import json, logging, sys
    logging.basicConfig(level=logging.INFO, stream=sys.stderr)
    from engine_ref.plugins import load_general_plugins
    from engine_ref.model_executor.models.registry import ModelRegistry
    first = load_general_plugins()
    second = load_general_plugins()
    import {PACKAGE}
    print(json.dumps({{
        "first": first, "second": second, "calls": {PACKAGE}.CALLS,
        "imported": sorted(m.rpartition(".")[2] for m in sys.modules if m.startswith("{PACKAGE}.")),
        "archs": ModelRegistry.get_supported_archs(),
        "torch_imported": "torch" in sys.modules,
    }}))
"""


def ours(names: list[str]) -> list[str]:
    """Our plugins among ``names`` (the environment may hold other engine_ref plugins)."""
    return [n for n in names if n in ENTRY_POINTS]


def test_plugins_run_once_per_process(site_dir: Path) -> None:
    result, _ = run_python(LOAD_TWICE, site_dir)
    assert ours(result["first"]) == WORKING  # the names that ran, in entry point order
    assert result["second"] == []
    assert result["calls"] == ["a", "broken", "b", "oot"]  # each called exactly once
    assert result["archs"] == [*ARCHITECTURES, OOT_ARCH]
    assert not result["torch_imported"]  # the lazy registration imported no model


@pytest.mark.parametrize(("allowed", "expected"), [
    (None, WORKING),
    ("a", ["a"]),
    ("", []),
    ("b, a", ["a", "b"]),
    ("oot,not-installed", ["oot"]),
])
def test_engine_ref_plugins_allow_list(site_dir: Path, allowed: str | None, expected: list[str]) -> None:
    result, _ = run_python(LOAD_TWICE, site_dir, plugins=allowed)
    assert ours(result["first"]) == expected
    # A plugin that is not allowed is not even imported.
    imported = {ENTRY_POINTS[name] for name in ENTRY_POINTS if allowed is None or name in expected}
    assert set(result["imported"]) == imported
    assert (OOT_ARCH in result["archs"]) == ("oot" in expected)


def test_failing_plugin_is_logged_and_skipped(site_dir: Path) -> None:
    result, stderr = run_python(LOAD_TWICE, site_dir, plugins="a,broken,b")
    assert result["first"] == ["a", "b"]
    assert result["calls"] == ["a", "broken", "b"]  # the ones after the broken plugin still ran
    assert "engine_ref plugin 'broken'" in stderr and "failed and was skipped" in stderr
    assert "RuntimeError: plugin broken on purpose: 9913" in stderr
    assert "plugin_broken.py" in stderr  # with its traceback


def test_list_models_cli_shows_plugin_architectures(site_dir: Path) -> None:
    script = """
        import contextlib, io, json
        from engine_ref.entrypoints.cli import main
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            rc = main(["list-models", "--json"])
        print(json.dumps({"rc": rc, "models": json.loads(out.getvalue())}))
    """
    result, _ = run_python(script, site_dir, plugins="oot")
    assert result["rc"] == 0
    assert result["models"][OOT_ARCH] == f"{PACKAGE}.oot_model:OotLlamaForCausalLM"


def test_plugin_registered_model_runs_end_to_end(site_dir: Path, tmp_path: Path,
                                                 tiny_checkpoint: Callable[..., Path]) -> None:
    """LLM(...) alone loads the plugin, which makes the out-of-tree architecture usable."""
    llama = tiny_checkpoint("LlamaForCausalLM")
    script = f"""
        import json
        from engine_ref import LLM, ModelRegistry, make_checkpoint
        from engine_ref.model_executor.models.registry import _ModelRegistry
        from {PACKAGE}.oot_model import OotLlamaForCausalLM
        import {PACKAGE}

        # The checkpoint is written through a private registry: the global one learns the
        # architecture only from the plugin, which nothing here loads before LLM(...) does.
        private = _ModelRegistry({{}})
        private.register_model("{OOT_ARCH}", OotLlamaForCausalLM)
        oot = make_checkpoint("{OOT_ARCH}", {str(tmp_path / "oot")!r}, registry=private)
        known_before = "{OOT_ARCH}" in ModelRegistry.get_supported_archs()

        prompts = [[1, 5, 9], [1, 20, 30, 40, 50, 60, 70]]
        kwargs = dict(max_model_len=64, max_num_batched_tokens=64, device_memory="256MiB")
        outputs, infos = {{}}, {{}}
        for backend in ("uni", "mp"):
            with LLM(str(oot), distributed_executor_backend=backend, **kwargs) as llm:
                outputs[backend] = llm.generate(prompt_token_ids=prompts, max_tokens=6, ignore_eos=True)
                infos[backend] = llm.engine.config.model_info.to_dict()
        with LLM({str(llama)!r}, **kwargs) as llm:
            reference = llm.generate(prompt_token_ids=prompts, max_tokens=6, ignore_eos=True)
        print(json.dumps({{"known_before": known_before, "outputs": outputs, "infos": infos,
                           "reference": reference, "calls": {PACKAGE}.CALLS}}))
    """
    result, _ = run_python(script, site_dir, plugins="oot", timeout=300)
    assert result["known_before"] is False
    assert result["calls"] == ["oot"]  # once, though EngineCore and the in-process worker both ask
    for backend in ("uni", "mp"):
        info = result["infos"][backend]
        assert (info["architecture"], info["module"]) == (OOT_ARCH, f"{PACKAGE}.oot_model")
        # Llama's layers on the same weights: the same greedy tokens.
        assert result["outputs"][backend] == result["reference"]
    assert [len(tokens) for tokens in result["reference"]] == [6, 6]
