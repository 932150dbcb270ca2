"""General plugins, through real installed entry points (tests/plugin_dists.py), in engine_ref and in the
``plugins`` check.

Plugins load once per process, so each case runs in a fresh interpreter (or a pytester subprocess) that
has the plugin site on PYTHONPATH; ENGINE_REF_PLUGINS picks the entry points a case needs.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import ARCHITECTURES
from tests.plugin_dists import CLASS_ARCH, CUDA_PKG, ENTRY_POINTS, OOT_ARCH, PACKAGE, write_plugin_site

WORKING = "a,b,oot,class"
BROKEN_LINE = "plugin_broken.py:8"


@pytest.fixture(scope="module")
def site_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_plugin_site(tmp_path_factory.mktemp("site"))


def _env(site: Path, plugins: str | None) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(site), env.get("PYTHONPATH")]))
    env.pop("ENGINE_REF_PLUGINS", None)
    if plugins is not None:
        env["ENGINE_REF_PLUGINS"] = plugins
    return env


def run_python(script: str, site: Path, plugins: str | None = None, timeout: float = 120) -> tuple[Any, str]:
    """Run ``script`` in a fresh interpreter that sees the site dir; return (its last stdout line as JSON, stderr).

    ``plugins`` is ENGINE_REF_PLUGINS (None: unset).
    """
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(script)], env=_env(site, plugins),
                         capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, f"stdout:\n{out.stdout}\nstderr:\n{out.stderr}"
    return json.loads(out.stdout.strip().splitlines()[-1]), out.stderr


def run_cli(site: Path, plugins: str | None, *argv: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "engine_ref.entrypoints.cli", *argv], env=_env(site, plugins),
                          capture_output=True, text=True, timeout=timeout)


LOAD_TWICE = f"""
    import json, sys
    from engine_ref.plugins import load_general_plugins
    from engine_ref.model_executor.models.registry import ModelRegistry
    first = load_general_plugins()
    second = load_general_plugins()
    import {PACKAGE}
    print(json.dumps({{
        "first": first, "second": second, "calls": {PACKAGE}.CALLS,
        "imported": sorted(m.rpartition(".")[2] for m in sys.modules if m.startswith("{PACKAGE}.")),
        "archs": ModelRegistry.get_supported_archs(),
    }}))
"""


def ours(names: list[str]) -> list[str]:
    """Our plugins among ``names`` (the environment may hold other engine_ref plugins)."""
    return [n for n in names if n in ENTRY_POINTS]


def test_plugins_run_once_per_process(site_dir: Path) -> None:
    result, _ = run_python(LOAD_TWICE, site_dir, plugins=WORKING)
    assert ours(result["first"]) == ["a", "b", "oot", "class"]  # the names that ran, in entry point order
    assert result["second"] == []
    assert result["calls"] == ["a", "b", "oot", "class"]  # each called exactly once
    assert result["archs"] == [*ARCHITECTURES, OOT_ARCH, CLASS_ARCH]  # the lazy one and the class-registered one


@pytest.mark.parametrize(("allowed", "expected"), [
    ("a", ["a"]),
    ("", []),
    ("b, a", ["a", "b"]),
    ("oot,not-installed", ["oot"]),
])
def test_engine_ref_plugins_allow_list(site_dir: Path, allowed: str, expected: list[str]) -> None:
    result, _ = run_python(LOAD_TWICE, site_dir, plugins=allowed)
    assert ours(result["first"]) == expected
    # A plugin that is not allowed is not even imported.
    assert set(result["imported"]) == {ENTRY_POINTS[name] for name in expected}
    assert (OOT_ARCH in result["archs"]) == ("oot" in expected)


FAILING = """
    import json
    from engine_ref.plugins import PluginLoadError, load_general_plugins, plugin_failures
    import engine_ref_test_plugins
    errors = []
    for _ in range(2):
        try:
            load_general_plugins()
        except PluginLoadError as e:
            errors.append(str(e))
    kept = load_general_plugins(raise_on_failure=False)
    after = load_general_plugins()  # the failures were reported by the caller: the process goes on
    print(json.dumps({"errors": errors, "calls": engine_ref_test_plugins.CALLS, "kept": kept, "after": after,
                      "failures": [f.entry.name for f in plugin_failures()]}))
"""


def test_failing_plugin_raises_naming_distribution_entry_point_and_line(site_dir: Path) -> None:
    result, _ = run_python(FAILING, site_dir, plugins="a,broken,b")
    first, second = result["errors"]
    assert first == second  # every later call raises it again: no engine starts without the plugin
    assert (f"engine_ref plugin 'broken' ({PACKAGE}.plugin_broken:register) of distribution {PACKAGE} raised "
            f"RuntimeError: plugin broken on purpose: 9913 at ") in first
    assert BROKEN_LINE in first and "ENGINE_REF_PLUGINS='a,b'" in first  # where, and how to start without it
    assert result["calls"] == ["a", "broken", "b"]  # the ones after the broken plugin still ran
    assert (result["kept"], result["after"], result["failures"]) == ([], [], ["broken"])


@pytest.mark.parametrize("argv", [["list-models"], ["startup", "LlamaForCausalLM"],
                                  ["make-checkpoint", "LlamaForCausalLM", "{tmp}/ckpt"]])
def test_cli_fails_on_a_failing_plugin_in_one_line(site_dir: Path, tmp_path: Path, argv: list[str]) -> None:
    out = run_cli(site_dir, "a,broken", *[a.format(tmp=tmp_path) for a in argv])
    assert out.returncode == 2, out.stderr
    assert out.stderr.count("\n") == 1 and "Traceback" not in out.stderr
    assert out.stderr.startswith("engine-ref: error: engine_ref plugin 'broken'") and BROKEN_LINE in out.stderr


def test_cli_startup_and_make_checkpoint_know_plugin_architectures(site_dir: Path, tmp_path: Path) -> None:
    made = run_cli(site_dir, "oot", "make-checkpoint", OOT_ARCH, str(tmp_path / "oot"))
    assert made.returncode == 0, made.stderr
    assert json.loads((tmp_path / "oot" / "config.json").read_text())["architectures"] == [OOT_ARCH]
    modes = {p.name: oct(p.stat().st_mode & 0o777) for p in (tmp_path / "oot").iterdir()}
    assert modes["model.safetensors"] == modes["config.json"]  # written like config.json, not 0600
    started = run_cli(site_dir, "class", "startup", CLASS_ARCH, "--json", "--device-memory", "256MiB",
                      "--max-model-len", "64")
    assert started.returncode == 0, started.stderr
    assert json.loads(started.stdout)["architecture"] == CLASS_ARCH


def test_engine_fixture_knows_plugin_architectures(site_dir: Path, pytester: pytest.Pytester,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(site_dir), os.environ.get("PYTHONPATH")])))
    monkeypatch.setenv("ENGINE_REF_PLUGINS", "oot")
    pytester.makepyfile(f"""
        def test_oot(engine):
            llm = engine("{OOT_ARCH}", max_model_len=64, device_memory="256MiB")
            assert llm.startup_report.architecture == "{OOT_ARCH}"
    """)
    pytester.runpytest_subprocess("-p", "no:cacheprovider").assert_outcomes(passed=1)


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


# -- the plugins check, through pytest --enginecheck -----------------------------------------------


def run_enginecheck(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, site: Path, plugins: str,
                    *args: str) -> tuple[pytest.RunResult, dict[str, dict[str, Any]]]:
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")])))
    monkeypatch.setenv("ENGINE_REF_PLUGINS", plugins)
    report = pytester.path / "enginecheck.json"
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "--enginecheck", f"--enginecheck-json={report}",
                                           *args)
    results = json.loads(report.read_text())["results"] if report.exists() else []
    return result, {r["arch"]: r for r in results if r["check"] == "plugins"}


def test_plugins_check_verdicts(site_dir: Path, pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    result, plugins = run_enginecheck(pytester, monkeypatch, site_dir, "a,broken,oot,class,cuda,warm_only,cudapkg",
                                      "--enginecheck-checks=plugins,import", "--continue-on-collection-errors")
    assert result.ret == 1  # a failing plugin fails the run
    outcomes = {arch: r["outcome"] for arch, r in plugins.items()}
    assert outcomes == {"plugin:a": "passed", "plugin:oot": "passed", "plugin:class": "passed",
                        "plugin:warm_only": "failed", "plugin:cudapkg": "passed"}  # a query fails only in strict mode
    # 'broken' and 'cuda' raise while the target is described: collection errors, not items (more in
    # tests/pytest_enginecheck/test_plugin_errors.py).
    result.stdout.fnmatch_lines([
        f"Loading engine_ref plugin 'broken' ({PACKAGE}.plugin_broken:register) of distribution {PACKAGE} raised "
        f"RuntimeError: plugin broken on purpose: 9913 at *{BROKEN_LINE}",
        f"Loading engine_ref plugin 'cuda' ({PACKAGE}.plugin_cuda:register) of distribution {PACKAGE} touched CUDA: "
        "it initialized CUDA: torch.cuda.current_device at *cuda_device.py:5*",
        f"Import chain: {PACKAGE}.plugin_cuda -> {PACKAGE}.cuda_layers -> {PACKAGE}.cuda_device.",
        "ERROR enginecheck::plugin:broken", "ERROR enginecheck::plugin:cuda"])
    warm = plugins["plugin:warm_only"]["message"]
    assert "works here but fails in a fresh interpreter" in warm
    assert "AttributeError: module 'engine_ref' has no attribute 'model_executor'" in warm
    # The architectures of the working plugins are checked like the bundled ones; the failing plugins take
    # none of the others down.
    imports = json.loads((pytester.path / "enginecheck.json").read_text())["results"]
    assert {r["arch"]: r["outcome"] for r in imports if r["check"] == "import"} == dict.fromkeys(
        [*ARCHITECTURES, OOT_ARCH, CLASS_ARCH, "WarmOnlyForCausalLM"], "passed")


def test_plugin_package_init_querying_cuda_fails_strict(site_dir: Path, pytester: pytest.Pytester,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    result, plugins = run_enginecheck(pytester, monkeypatch, site_dir, "cudapkg", "--enginecheck-checks=plugins",
                                      "--enginecheck-strict")
    assert result.ret == 1
    message = plugins["plugin:cudapkg"]["message"]
    assert message.startswith(f"Loading engine_ref plugin 'cudapkg' ({CUDA_PKG}:register) of distribution {CUDA_PKG} "
                              f"queried CUDA: it called torch.cuda.device_count() at ")
    assert f"{CUDA_PKG}/__init__.py:5" in message and f"Import chain: {CUDA_PKG}." in message


def test_default_run_with_a_raising_plugin_is_not_green(site_dir: Path, pytester: pytest.Pytester,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """The issue's case: the raising plugin's architecture vanished and the run exited 0. Now it is a collection
    error, and pytest stops as for a test module that fails to import."""
    result, _ = run_enginecheck(pytester, monkeypatch, site_dir, "a,broken", "--enginecheck-checks=plugins,import")
    assert result.ret == pytest.ExitCode.INTERRUPTED
    result.stdout.fnmatch_lines(["Loading engine_ref plugin 'broke*", "ERROR enginecheck::plugin:broken"])


# -- docs/engine_ref-authors.md's "Check your own model", run as written -----------------------------


def readme_files() -> dict[str, str]:
    """The code blocks of "Check your own model" in docs/engine_ref-authors.md (the README links it), by the file
    each names on its first line (``# path``)."""
    page = (Path(__file__).parents[2] / "docs" / "engine_ref-authors.md").read_text()
    section = page.split("\n## Check your own model\n", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```(?:python|toml)\n(.*?)```", section, flags=re.S)
    return {block.splitlines()[0].removeprefix("# "): block for block in blocks}


def test_readme_example_passes_every_check(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    files = readme_files()
    assert set(files) == {"my_models/tiny.py", "my_models/plugin.py", "pyproject.toml"}
    site = pytester.mkdir("site")
    for name, text in files.items():
        if name.endswith(".py"):
            (site / name).parent.mkdir(exist_ok=True)
            (site / name).write_text(text)
    (site / "my_models" / "__init__.py").write_text("")
    entry_points = tomllib.loads(files["pyproject.toml"])["project"]["entry-points"]["engine_ref.general_plugins"]
    info = site / "my_models-0.1.dist-info"  # what `pip install -e .` of that pyproject leaves
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: my_models\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(
        "[engine_ref.general_plugins]\n" + "".join(f"{k} = {v}\n" for k, v in entry_points.items()))
    result, plugins = run_enginecheck(pytester, monkeypatch, Path(site), "my_models",
                                      "--enginecheck-checks=plugins,import,inspect,load,startup", "-k",
                                      "TinyLlama or my_models", "-v")
    result.assert_outcomes(passed=6, deselected=len(ARCHITECTURES) * 5)
    assert plugins["plugin:my_models"]["outcome"] == "passed"
    result.stdout.fnmatch_lines(["*enginecheck::TinyLlamaForCausalLM::load?tp=2? PASSED*"])


def test_fail_on_skip_plugins_fails_a_skip_of_what_the_plugins_registered_only(
        site_dir: Path, pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    """No silent green for an author's own models: with --enginecheck-fail-on-skip=plugins, the plugin's
    OotLlamaForCausalLM fails an item it would skip (4 heads over 3 ranks), the bundled Llama's stays a skip, and the
    summary names the reason without -rs."""
    report = pytester.path / "enginecheck.json"
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(site_dir), os.environ.get("PYTHONPATH")])))
    monkeypatch.setenv("ENGINE_REF_PLUGINS", "oot")
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "--enginecheck", "-m", "enginecheck",
                                           f"--enginecheck-json={report}", "--enginecheck-checks=load",
                                           "--enginecheck-tp=3", "--enginecheck-fail-on-skip=plugins", "-k",
                                           "LlamaForCausalLM and not Llava")
    results = {r["arch"]: r for r in json.loads(report.read_text())["results"]}
    assert (results["OotLlamaForCausalLM"]["outcome"], results["LlamaForCausalLM"]["outcome"]) == ("failed", "skipped")
    oot = results["OotLlamaForCausalLM"]
    assert oot["message"].startswith("OotLlamaForCausalLM load[tp=3] was not checked (")
    assert oot["message"].endswith("--enginecheck-fail-on-skip selects OotLlamaForCausalLM: make the check apply to "
                                   "it, or leave it out of --enginecheck-fail-on-skip.")
    assert oot["detail"]["kind"] == "required_skip"
    assert result.ret == 1
    result.stdout.fnmatch_lines(["skipped 1: tensor_parallel_size=3 does not divide*", "*(LlamaForCausalLM)"])
