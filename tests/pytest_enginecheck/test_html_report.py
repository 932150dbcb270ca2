"""The HTML report: what its memory bars hold and on which scale, its compact JSON, its counts, and the page in a
real headless Chromium (Debian's package; ``.ci/chromium`` installs it): a click on a failing cell shows that item's
message, the architecture column stays in view when the grid scrolls, a baseline's regressions come first, nothing
is fetched, and a screenshot can be taken. Skipped, with the reason, where Chromium is not installed."""

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

from pytest_enginecheck.html_report import compact_json, counts_line, memory_bars, render
from pytest_enginecheck.report_diff import Baseline
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
VLLM_RANK = {"rank": 1, "weights": 1000, "buffers": 10, "activation_peak": 300, "kv_cache_allocated": 90000,
             "kv_one_request": 2048, "needs": 3358}


def _budget(*ranks: dict[str, Any], budget: str = "512MiB") -> dict[str, Any]:
    return {"arch": "A", "check": "budget[tp=2]", "outcome": "passed", "duration_s": 1.0, "phases": {},
            "message": "", "detail": {"tensor_parallel_size": len(ranks), "budget": budget,
                                      "memory_per_rank": list(ranks)}}


def test_memory_bars_have_the_models_own_categories_per_rank() -> None:
    """The model's own memory is drawn; the KV cache, which fills what the capacity leaves, is written beside."""
    bars = memory_bars(_budget(ENGINE_REF_RANK, ENGINE_REF_RANK))
    assert [b["rank"] for b in bars] == [0, 1]
    own = 214272 + 32 + 4227072 + 0
    assert bars[0] == {"rank": 0, "capacity": 536870912, "was": None,
                       "rest": "KV cache: 456.56 MiB of capacity 512.00 MiB", "parts": [
                           ("weights", 214272, round(100 * 214272 / own, 3)), ("buffers", 32, round(3200 / own, 3)),
                           ("activation peak", 4227072, round(100 * 4227072 / own, 3)), ("LoRA", 0, 0.0)]}
    # vLLM: one request's KV is what the budget holds against (the model's own); what vLLM allocated is written
    assert memory_bars(_budget(VLLM_RANK, budget="1MiB")) == [{
        "rank": 1, "capacity": 2**20, "was": None,
        "rest": "KV cache allocated (not counted): 87.89 KiB; capacity 1.00 MiB",
        "parts": [(label, size, round(100 * size / 3358, 3)) for label, size in (
            ("weights", 1000), ("buffers", 10), ("activation peak", 300), ("KV (one request)", 2048))]}]
    assert memory_bars({**_budget(), "detail": {}}) == []


def test_a_10_percent_larger_activation_peak_is_drawn_10_percent_longer() -> None:
    """The scale is the largest sum of the model's own categories over the item's ranks and its baseline's, so
    the baseline's bar and the grown one are comparable, and the growth is not lost in the KV cache."""
    grown = {**ENGINE_REF_RANK, "activation_peak": 4227072 * 11 // 10, "kv_cache": ENGINE_REF_RANK["kv_cache"] - 422707}
    bars = memory_bars(_budget(grown, grown), was=_budget(ENGINE_REF_RANK, ENGINE_REF_RANK))
    now, was = dict((p[0], p[2]) for p in bars[0]["parts"]), dict((p[0], p[2]) for p in bars[0]["was"])
    assert sum(now.values()) == pytest.approx(100, abs=0.01)  # the largest bar fills the width
    assert now["activation peak"] / was["activation peak"] == pytest.approx(1.1, rel=1e-3)
    assert now["activation peak"] - was["activation peak"] > 8  # 8 % of the bar's width, not 0.8 % of the capacity
    assert now["weights"] == was["weights"]
    assert "KV cache" not in now and bars[0]["rest"] == "KV cache: 456.16 MiB of capacity 512.00 MiB"
    # a rank the baseline lacks (it ran at TP=1) is drawn without a baseline bar
    assert memory_bars(_budget(grown, grown), was=_budget(ENGINE_REF_RANK))[1]["was"] is None


def test_compact_json_keeps_a_list_of_scalars_on_one_line() -> None:
    detail = {"tokens": [1, 2, 3], "names": ["a", "b"], "per_rank": [{"rank": 0, "sizes": [5, 6]}], "empty": {},
              "none": [], "deep": {"x": None, "y": [True, 1.5]}}
    text = compact_json(detail)
    assert json.loads(text) == detail
    assert text == (
        '{\n  "tokens": [1, 2, 3],\n  "names": ["a", "b"],\n  "per_rank": [\n    {\n      "rank": 0,\n'
        '      "sizes": [5, 6]\n    }\n  ],\n  "empty": {},\n  "none": [],\n  "deep": {\n    "x": null,\n'
        '    "y": [true, 1.5]\n  }\n}')
    assert compact_json(list(range(500))).count("\n") == 0
    assert compact_json("Ünïcode <b>") == '"Ünïcode <b>"'


def test_counts_say_1_architecture_and_1_item() -> None:
    one = [{"arch": "A", "check": "import", "outcome": "failed", "detail": {}}]
    assert counts_line(one) == "1 architecture, 1 item: 1 failed, 0 skipped (a root failed), 0 skipped, 0 passed"
    two = [*one, {"arch": "B", "check": "import", "outcome": "skipped", "detail": {"kind": "dependency"}}]
    assert counts_line(two) == "2 architectures, 2 items: 1 failed, 1 skipped (a root failed), 0 skipped, 0 passed"


def _result(arch: str, check: str, outcome: str) -> dict[str, Any]:
    return {"arch": arch, "check": check, "outcome": outcome, "duration_s": 0.1, "phases": {}, "message": "",
            "detail": {}}


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


# appended to a page: scroll what scrolls (the grid's box, and the page) to the far right, and write where the
# first architecture cell and the last cell of its row were, before and after, into the DOM for --dump-dom
SCROLL_PROBE = """<script>
const cell = s => document.querySelector(s).getBoundingClientRect().left;
const first = "#grid tbody th", last = "#grid tbody tr td:last-child";
const before = [cell(first), cell(last)];
for (const box of [document.getElementById("grid").parentElement, document.scrollingElement]) box.scrollLeft = 1e6;
document.body.appendChild(Object.assign(document.createElement("pre"), {id: "probe", textContent: JSON.stringify({
  before, after: [cell(first), cell(last)], window: innerWidth, page: document.scrollingElement.scrollWidth})}));
</script>"""


def _probe(out: subprocess.CompletedProcess[str]) -> dict[str, Any]:
    found = re.search(r'<pre id="probe">(.*?)</pre>', out.stdout, re.S)
    assert found is not None, out.stdout[-2000:] + out.stderr[-2000:]
    return json.loads(html.unescape(found[1]))


@needs_chromium
def test_the_architecture_column_stays_in_view_when_the_grid_scrolls(tmp_path: Path) -> None:
    """30 checks at 800 px: the grid scrolls inside its box (the page itself is no wider than the window) and the
    architecture cell stays where it was while the row's last cell comes into view."""
    results = [_result(arch, f"check{i:02}", "passed") for arch in ("LlamaForCausalLM", "MixtralForCausalLM")
               for i in range(30)]
    page = tmp_path / "wide.html"
    page.write_text(render("t", results).replace("</body>", SCROLL_PROBE + "</body>"))
    probe = _probe(_chromium(tmp_path, "--dump-dom", "--window-size=800,900", page.as_uri()))
    assert probe["window"] == 800, probe
    assert probe["page"] <= probe["window"], f"the page is wider than the window (cut off or scrolled): {probe}"
    assert probe["before"][1] > 800 > probe["after"][1], f"the grid did not scroll to its last cell: {probe}"
    assert probe["after"][0] == probe["before"][0], f"the architecture column moved: {probe}"


@needs_chromium
def test_a_baselines_regressions_come_first_and_their_cells_are_marked(tmp_path: Path) -> None:
    old = [_result("A", "import", "failed"), _result("A", "load[tp=1]", "passed"),
           {**_budget(ENGINE_REF_RANK), "arch": "A"}]
    grown = {**ENGINE_REF_RANK, "activation_peak": ENGINE_REF_RANK["activation_peak"] * 2}
    new = [_result("A", "import", "passed"), _result("A", "load[tp=1]", "failed"), {**_budget(grown), "arch": "A"}]
    page = tmp_path / "since.html"
    page.write_text(render("t", new, baseline=Baseline("old.json", old)))
    out = _chromium(tmp_path, "--dump-dom", f"{page.as_uri()}#item={quote('enginecheck::A::budget[tp=2]', safe='')}")
    title = re.search(r'<h2 id="changes-title">(.*?)</h2>', out.stdout)
    assert title is not None, out.stdout[-2000:]
    assert title[1] == "Changes since the baseline old.json: 2 regressions, 1 improvement"
    kinds = re.findall(r'<li><span class="kind k-(\w+)">', out.stdout)
    assert kinds == ["regression", "regression", "improvement"]
    assert 'class="cell failed worse" data-item="enginecheck::A::load[tp=1]"' in out.stdout
    assert 'class="cell passed better" data-item="enginecheck::A::import"' in out.stdout
    assert "since the baseline, regression: rank 0: activation peak +100.0 % (+4.03 MiB; 4.03 MiB -&gt; 8.06 MiB)" \
        in out.stdout


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
    found = re.search(r'<script type="application/json" id="data">(.*?)</script>', page.read_text())
    assert found is not None
    data = json.loads(found[1])
    assert data["target"] == "zoo.root_causes:REGISTRY"
    assert sorted((r["arch"], r["check"]) for r in data["results"]) == [
        ("BrokenBuildLlamaForCausalLM", "import"), ("CudaAtImportLlamaForCausalLM", "import")]


def test_enginecheck_html_into_a_directory_is_a_usage_error(tmp_path: Path) -> None:
    out = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "--enginecheck",
                          f"--enginecheck-html={tmp_path}"], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert out.returncode == 4, out.stdout + out.stderr
    assert f"--enginecheck-html={str(tmp_path)!r}: it is a directory; give a file path" in out.stderr
