"""The HTML report: what its memory bars hold, and the page in a real headless Chromium (Debian's package;
``.ci/chromium`` installs it): a click on a failing cell shows that item's message, nothing is fetched, and a
screenshot can be taken. Skipped, with the reason, where Chromium is not installed."""

from __future__ import annotations

import html
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any
from urllib.parse import quote

import pytest

from pytest_enginecheck.html_report import memory_bars, render
from tests.zoo_sessions import ROOT_CAUSES, zoo_session

# the fixture that reads a shared zoo session -> its name (started early: tests/zoo_sessions.py)
ZOO_SESSIONS = {"report": "root-causes"}

ZOO = Path(__file__).parents[1] / "plugin_zoo"
CHROMIUM = next((found for name in ("chromium", "chromium-browser") if (found := shutil.which(name))), None)
needs_chromium = pytest.mark.skipif(CHROMIUM is None, reason="Chromium is not installed (.ci/chromium installs it "
                                                              "from Debian's packages)")
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync"]
FAILING = "enginecheck::BrokenBuildLlamaForCausalLM::load[tp=1]"

# what a budget[tp=2] result's detail holds: engine_ref's accounting (a real run's, abridged), and vLLM's
ENGINE_REF_RANK = {"capacity": 536870912, "weights": 214272, "buffers": 32, "lora": 0, "activation_peak": 4227072,
                   "kv_cache": 478740480, "total": 483181856}
VLLM_RANK = {"rank": 1, "weights": 1000, "buffers": 10, "activation_peak": 300, "kv_cache": 90000,
             "kv_one_request": 2048, "needs": 3358}


def _budget(*ranks: dict[str, Any], budget: str = "512MiB") -> dict[str, Any]:
    return {"arch": "A", "check": "budget[tp=2]", "outcome": "passed", "duration_s": 1.0, "phases": {},
            "message": "", "detail": {"tensor_parallel_size": len(ranks), "budget": budget,
                                      "memory_per_rank": list(ranks)}}


def test_memory_bars_have_each_category_per_rank() -> None:
    bars = memory_bars(_budget(ENGINE_REF_RANK, ENGINE_REF_RANK))
    assert [b["rank"] for b in bars] == [0, 1]
    assert bars[0] == {"rank": 0, "capacity": 536870912, "parts": [
        ("weights", 214272), ("buffers", 32), ("activation peak", 4227072), ("KV cache", 478740480), ("LoRA", 0)]}
    assert sum(size for _, size in bars[0]["parts"]) == ENGINE_REF_RANK["total"]
    # vLLM: one request's KV is what the budget holds against, not what vLLM allocated; the budget is the scale
    assert memory_bars(_budget(VLLM_RANK, budget="1MiB")) == [{"rank": 1, "capacity": 2**20, "parts": [
        ("weights", 1000), ("buffers", 10), ("activation peak", 300), ("KV (one request)", 2048)]}]
    assert memory_bars({**_budget(), "detail": {}}) == []


def _chromium(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    profile = tmp_path / f"profile-{len(list(tmp_path.glob('profile-*')))}"  # a fresh one per start
    assert CHROMIUM is not None
    return subprocess.run([CHROMIUM, *FLAGS, f"--user-data-dir={profile}", "--virtual-time-budget=5000", *args],
                          capture_output=True, text=True, timeout=120)


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, dict[str, Any]]]:
    """A real run over the zoo's root causes (the session test_checks and test_sharding read), its page written by
    ``merge --html``."""
    run_dir = tmp_path_factory.mktemp("html")
    session = zoo_session(tmp_path_factory, "root-causes", *ROOT_CAUSES)
    shutil.copyfile(session.dir / "report.json", run_dir / "run.json")
    out = subprocess.run([sys.executable, "-m", "pytest_enginecheck.report", "merge", str(run_dir / "run.json"),
                          "--json", str(run_dir / "merged.json"), "--html", str(run_dir / "report.html")],
                         capture_output=True, text=True, timeout=120)
    assert (run_dir / "report.html").exists(), out.stdout + out.stderr
    results = {f"enginecheck::{r['arch']}::{r['check']}": r
               for r in json.loads((run_dir / "run.json").read_text())["results"]}
    return run_dir / "report.html", results


def test_the_page_is_self_contained(report: tuple[Path, dict]) -> None:
    page = report[0].read_text()
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:)?//""", page), "the page fetches something"
    assert "@import" not in page and "<link" not in page


@needs_chromium
def test_clicking_a_failing_cell_shows_its_message(report: tuple[Path, dict], tmp_path: Path) -> None:
    page, results = report
    assert results[FAILING]["outcome"] == "failed"
    out = _chromium(tmp_path, "--dump-dom", f"{page.as_uri()}#click={quote(FAILING, safe='')}")
    assert out.returncode == 0, out.stderr[-2000:]
    message = re.search(r'<pre id="detail-message">(.*?)</pre>', out.stdout, re.S)
    assert message is not None, out.stdout[-2000:]
    assert html.unescape(message[1]) == results[FAILING]["message"]
    assert re.search(rf'<td class="cell failed open" data-item="{re.escape(html.escape(FAILING))}"', out.stdout)
    title = re.search(r'<h2 id="detail-title">(.*?)</h2>', out.stdout)
    assert title is not None and html.unescape(title[1]) == FAILING


@needs_chromium
def test_a_message_is_shown_as_text_never_as_markup(tmp_path: Path) -> None:
    """A check's message is the engine's text (a model's exception): the page shows it, it never runs it."""
    nasty = "Loading A raised ValueError: </script><img src=x onerror=alert(1)> & <b>bold</b>"
    page = tmp_path / "nasty.html"
    page.write_text(render("t", [{"arch": "A", "check": "import", "outcome": "failed", "duration_s": 0.1,
                                  "phases": {"check": 0.1}, "message": nasty, "detail": {"kind": "error"}}]))
    out = _chromium(tmp_path, "--dump-dom", f"{page.as_uri()}#item=enginecheck::A::import")
    message = re.search(r'<pre id="detail-message">(.*?)</pre>', out.stdout, re.S)
    assert message is not None and html.unescape(message[1]) == nasty, out.stdout[-2000:]
    assert "<img" not in out.stdout.split('<script type="application/json"')[0]


@needs_chromium
def test_a_screenshot_of_the_report(report: tuple[Path, dict], tmp_path: Path) -> None:
    shot = tmp_path / "report.png"
    out = _chromium(tmp_path, f"--screenshot={shot}", "--window-size=1200,800",
                    f"{report[0].as_uri()}#item={quote(FAILING, safe='')}")
    assert shot.exists(), out.stderr[-2000:]
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 10_000


def test_enginecheck_html_writes_the_page_at_the_end_of_a_run(tmp_path: Path) -> None:
    """``--enginecheck-html=PATH``: the same page, written by the run itself."""
    shutil.copytree(ZOO, tmp_path, dirs_exist_ok=True, ignore=shutil.ignore_patterns("__pycache__"))
    page = tmp_path / "out" / "report.html"
    out = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "--enginecheck",
                          "--enginecheck-target=zoo.root_causes:REGISTRY", "--enginecheck-checks=import",
                          f"--enginecheck-html={page}"], cwd=tmp_path, capture_output=True, text=True, timeout=600,
                         env={**os.environ, "PYTHONPATH": str(tmp_path)})
    assert page.exists(), out.stdout + out.stderr
    data = json.loads(re.search(r'<script type="application/json" id="data">(.*?)</script>', page.read_text())[1])
    assert data["target"] == "zoo.root_causes:REGISTRY"
    assert sorted((r["arch"], r["check"]) for r in data["results"]) == [
        ("BrokenBuildLlamaForCausalLM", "import"), ("CudaAtImportLlamaForCausalLM", "import")]


def test_enginecheck_html_into_a_directory_is_a_usage_error(tmp_path: Path) -> None:
    out = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "--enginecheck",
                          f"--enginecheck-html={tmp_path}"], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert out.returncode == 4, out.stdout + out.stderr
    assert f"--enginecheck-html={str(tmp_path)!r}: it is a directory; give a file path" in out.stderr
