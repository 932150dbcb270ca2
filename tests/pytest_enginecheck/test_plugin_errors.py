"""A general plugin that raises while the target is described is a collection error under its name, whatever
``--enginecheck-checks`` and ``-k`` select, and the header names the architectures it took with it.

Real plugin distributions (tests/plugin_dists.py): 'half' registers HALF_ARCH and then raises, 'broken' raises
before registering anything, 'cuda' initialises CUDA two imports below its module; 'oot' is the clean twin. One
``pytest --enginecheck`` subprocess per case, restricted to the import check and to one architecture by ``-k``
(a run with collection errors stops before running anything, so the failing case costs only its description).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.plugin_dists import HALF_ARCH, PACKAGE, write_plugin_site

COLLECTION_ERROR_EXIT = int(pytest.ExitCode.INTERRUPTED)  # what pytest exits with when a test module fails to import


def run_enginecheck(tmp_path: Path, site: Path, plugins: str) -> subprocess.CompletedProcess[str]:
    """``pytest --enginecheck --enginecheck-checks=import -k Oot`` with the site installed and ``plugins`` allowed:
    every item of the failing plugins is deselected, the clean twin's OOT_ARCH import runs."""
    env = {**os.environ, "ENGINE_REF_PLUGINS": plugins, "COLUMNS": "300",  # the header's lines unwrapped
           "PYTHONPATH": os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")]))}
    return subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "--enginecheck",
                           "--enginecheck-checks=import", "-k", "Oot"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_plugin_site(tmp_path_factory.mktemp("site"))


@pytest.fixture(scope="module")
def failing(site: Path, tmp_path_factory: pytest.TempPathFactory) -> subprocess.CompletedProcess[str]:
    return run_enginecheck(tmp_path_factory.mktemp("failing"), site, "oot,broken,half,cuda")


def test_a_raising_plugin_is_a_collection_error_though_its_items_are_not_selected(
        failing: subprocess.CompletedProcess[str]) -> None:
    assert failing.returncode == COLLECTION_ERROR_EXIT, failing.stdout + failing.stderr
    lines = failing.stdout.splitlines()
    for name in ("broken", "cuda", "half"):
        assert f"ERROR enginecheck::plugin:{name}" in lines
    assert "Interrupted: 3 errors during collection" in failing.stdout
    half = f"Loading engine_ref plugin 'half' ({PACKAGE}.plugin_half:register) of distribution {PACKAGE} raised "
    assert any(line.startswith(half + "RuntimeError: plugin half broken on purpose after registering: 4471 at ")
               and line.endswith("plugin_half.py:14") for line in lines)
    assert f"It failed while the target was described; not checked: {HALF_ARCH} (registered by it before it raised)." \
        in lines
    assert "Fix or uninstall it, or leave it out with ENGINE_REF_PLUGINS='oot' (the names to load; empty loads none)." \
        in lines
    # A plugin that initialises CUDA reads as the plugins check words it: the API, where, and the import chain.
    assert "initialized CUDA: torch.cuda.current_device at " in failing.stdout and "cuda_device.py:5" in failing.stdout
    assert f"Import chain: {PACKAGE}.plugin_cuda -> {PACKAGE}.cuda_layers -> {PACKAGE}.cuda_device." in failing.stdout


def test_the_header_names_the_architectures_a_raising_plugin_took_with_it(
        failing: subprocess.CompletedProcess[str]) -> None:
    header = [line for line in failing.stdout.splitlines() if line.startswith("enginecheck: ")]
    assert header[0].startswith("enginecheck: target=engine_ref (")  # the settings lines, as before
    assert header[1] == "enginecheck: checks=import" and HALF_ARCH not in "".join(header[:2])
    assert header[2:] == [
        f"enginecheck: plugin '{name}' of distribution {PACKAGE} raised while the target was described (ERROR "
        f"collecting enginecheck::plugin:{name}): {lost}" for name, lost in [
            ("broken", "it registered no architecture before it raised: which ones it would have registered cannot "
                       "be known"),
            ("cuda", "it registered no architecture before it raised: which ones it would have registered cannot "
                     "be known"),
            ("half", f"not checked: {HALF_ARCH} (registered by it before it raised)")]]  # in entry point order


def test_the_clean_twin_run_is_unchanged(site: Path, tmp_path: Path,
                                         failing: subprocess.CompletedProcess[str]) -> None:
    clean = run_enginecheck(tmp_path, site, "oot")
    assert clean.returncode == 0, clean.stdout + clean.stderr
    assert "1 passed" in clean.stdout and "error" not in clean.stdout.lower()
    header = [line for line in clean.stdout.splitlines() if line.startswith("enginecheck: ")]
    assert len(header) == 2 and "architectures, 1 plugin)" in header[0]
    # The failing run checks the same architectures: the bundled ones and OOT_ARCH, not the one 'half' took with it.
    assert architectures(header[0]) == architectures(failing.stdout)


def architectures(text: str) -> int:
    """The architecture count of the settings line in ``text``."""
    found = re.search(r"^enginecheck: target=engine_ref \((\d+) architectures", text, flags=re.M)
    assert found, text
    return int(found.group(1))
