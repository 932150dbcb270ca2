"""The self-contained HTML report (``--enginecheck-html=PATH``, and ``merge --html``): one file, nothing fetched.

An architecture x check grid coloured by outcome (architectures with a failure first), filtered by check and
outcome; a cell opens its message, failure detail and phase timings (so does the URL fragment
``#item=enginecheck::<arch>::<check>``; ``#click=...`` clicks that cell); the budget items' per-rank memory by
category as stacked bars. The results travel as JSON inside the page and its inline script draws it (named
``html_report``, not ``html``: this module uses the standard library's ``html``).
"""

from __future__ import annotations

import html
import json
import os
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pytest_enginecheck.checks import CHECKS

# (key in a budget result's memory_per_rank, label): engine_ref's categories, and vLLM's one request of KV
CATEGORIES = (("weights", "weights"), ("buffers", "buffers"), ("activation_peak", "activation peak"),
              ("kv_cache", "KV cache"), ("kv_one_request", "KV (one request)"), ("lora", "LoRA"))
_UNITS = {"": 1, "B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40, "KB": 10**3, "MB": 10**6,
          "GB": 10**9, "TB": 10**12}


def _size(text: object) -> int | None:
    match = re.fullmatch(r"\s*([0-9.]+)\s*([KMGT]i?B|B)?\s*", str(text)) if text is not None else None
    return int(float(match[1]) * _UNITS[match[2] or ""]) if match else None


def memory_bars(result: dict[str, Any]) -> list[dict[str, Any]]:
    """Per rank of a budget result: its capacity and (label, bytes) per category present, in CATEGORIES order
    (vLLM's ``kv_cache`` is what it allocated beyond the budget's need: its ``kv_one_request`` is shown instead)."""
    ranks = result.get("detail", {}).get("memory_per_rank")
    if not isinstance(ranks, list):
        return []
    budget = _size(result["detail"].get("budget"))
    bars = []
    for rank, memory in enumerate(ranks):
        if not isinstance(memory, dict):
            continue
        keys = [k for k, _ in CATEGORIES if isinstance(memory.get(k), int)]
        if "kv_one_request" in keys and "kv_cache" in keys:
            keys.remove("kv_cache")
        parts = [(label, memory[k]) for k, label in CATEGORIES if k in keys]
        capacity = memory.get("capacity") if isinstance(memory.get("capacity"), int) else budget
        bars.append({"rank": memory.get("rank", rank), "capacity": capacity, "parts": parts})
    return bars


def _check_order(check: str) -> tuple[int, str]:
    base = check.split("[")[0]
    return (CHECKS.index(base) if base in CHECKS else len(CHECKS), check)


def render(target: str, results: Sequence[dict[str, Any]], notes: Sequence[str] = ()) -> str:
    """The page for ``results`` (the ``--enginecheck-json`` results) of ``target``; ``notes``: lines shown above
    the grid (a merge's duplicate and missing items)."""
    archs = sorted({r["arch"] for r in results})
    failing = {r["arch"] for r in results if r["outcome"] == "failed"}
    data = {
        "target": target,
        "archs": [a for a in archs if a in failing] + [a for a in archs if a not in failing],
        "checks": sorted({r["check"] for r in results}, key=_check_order),
        "results": [{**r, "bars": memory_bars(r)} for r in results],
        "notes": list(notes),
        "categories": [label for _, label in CATEGORIES],
    }
    payload = json.dumps(data).replace("<", "\\u003c")  # nothing in it can close the script element
    title = html.escape(f"enginecheck: {target}")
    return _PAGE.replace("__TITLE__", title).replace("__DATA__", payload)


def write_html(path: str | Path, target: str, results: Sequence[dict[str, Any]], notes: Sequence[str] = ()) -> None:
    """Write the page atomically (no temp file is left behind)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(render(target, results, notes), encoding="utf-8")
        tmp.replace(path)
    finally:
        tmp.unlink(missing_ok=True)


_PAGE = """<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>__TITLE__</title>
<meta name="viewport" content="width=device-width, initial-scale=1">
<style>
body{font:14px/1.4 system-ui,sans-serif;margin:16px;color:#1d1d1f;background:#fff}
h1{font-size:20px;margin:0 0 4px}h2{font-size:16px;margin:18px 0 6px}
#counts span{margin-right:12px}.note{color:#a00}
fieldset{display:inline-block;border:1px solid #ccc;margin:6px 8px 6px 0;padding:4px 8px}
fieldset label{margin-right:8px;white-space:nowrap}
table.grid{border-collapse:collapse;margin-top:8px}
.grid th,.grid td{border:1px solid #ddd;padding:3px 6px;text-align:center;white-space:nowrap}
.grid th.arch{text-align:left;font-weight:normal;font-family:ui-monospace,monospace}
.grid thead th{position:sticky;top:0;background:#f4f4f6;font-family:ui-monospace,monospace;font-size:12px}
td.cell{cursor:pointer;font-weight:600;font-size:12px}
td.passed{background:#d6f5dd;color:#14532d}td.failed{background:#f8c9c9;color:#7f1d1d}
td.skipped{background:#eceff3;color:#555}td.dependency{background:#fde7c2;color:#7a4b00}
td.none{color:#bbb}td.open{outline:3px solid #1f6feb;outline-offset:-3px}
#detail{border:1px solid #ccc;border-radius:6px;padding:8px 12px;margin-top:12px;display:none}
#detail pre{white-space:pre-wrap;word-break:break-word;background:#f7f7f9;padding:8px;max-height:28em;overflow:auto}
#detail table td{padding:1px 10px 1px 0;font-family:ui-monospace,monospace}
.bar{display:flex;height:16px;border:1px solid #999;width:520px;background:#fff;margin:2px 0}
.bar div{height:100%}.rank{font-family:ui-monospace,monospace;font-size:12px}
.legend span{display:inline-block;margin-right:10px}
.legend i{display:inline-block;width:10px;height:10px;margin-right:3px}
</style></head><body>
<h1 id="title"></h1><div id="counts"></div><div id="notes"></div>
<div><fieldset id="f-outcome"><legend>outcome</legend></fieldset>
<fieldset id="f-check"><legend>check</legend></fieldset></div>
<table class="grid" id="grid"></table>
<section id="detail"><h2 id="detail-title"></h2><div id="detail-outcome"></div>
<pre id="detail-message"></pre><div id="detail-bars"></div><h2>phase timings</h2><table id="detail-phases"></table>
<h2>detail</h2><pre id="detail-json"></pre></section>
<h2>memory per rank (budget items)</h2><div class="legend" id="legend"></div><div id="memory"></div>
<script type="application/json" id="data">__DATA__</script>
<script>
"use strict";
const D = JSON.parse(document.getElementById("data").textContent);
const COLORS = ["#4e79a7", "#9c755f", "#f28e2b", "#59a14f", "#76b7b2", "#e15759"];
const OUTCOMES = ["failed", "dependency", "skipped", "passed"];
const byItem = new Map(D.results.map(r => [`enginecheck::${r.arch}::${r.check}`, r]));
const kind = r => r.outcome === "skipped" && r.detail && r.detail.kind === "dependency" ? "dependency" : r.outcome;
const LABEL = {passed: "ok", failed: "FAIL", skipped: "skip", dependency: "skip"};
const el = (tag, attrs = {}, text) => { const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) e.setAttribute(k, v);
  if (text !== undefined) e.textContent = text; return e; };
const fmt = b => b >= 2 ** 30 ? (b / 2 ** 30).toFixed(2) + " GiB" : b >= 2 ** 20 ? (b / 2 ** 20).toFixed(2) + " MiB"
  : b >= 2 ** 10 ? (b / 2 ** 10).toFixed(1) + " KiB" : b + " B";
document.getElementById("title").textContent = document.title;
const counts = {}; D.results.forEach(r => { counts[kind(r)] = (counts[kind(r)] || 0) + 1; });
document.getElementById("counts").textContent = `${D.archs.length} architectures, ${D.results.length} items: ` +
  OUTCOMES.map(o => `${counts[o] || 0} ${o === "dependency" ? "skipped (a root failed)" : o}`).join(", ");
D.notes.forEach(n => document.getElementById("notes").appendChild(el("div", {class: "note"}, n)));
function boxes(id, values, label) { const f = document.getElementById(id);
  values.forEach(v => { const l = el("label"); const c = el("input", {type: "checkbox", value: v});
    c.checked = true; c.addEventListener("change", draw); l.append(c, " " + label(v)); f.appendChild(l); }); }
boxes("f-outcome", OUTCOMES, o => o === "dependency" ? "skipped (root failed)" : o);
boxes("f-check", D.checks, c => c);
const on = id => new Set([...document.querySelectorAll(`#${id} input:checked`)].map(c => c.value));
function draw() {
  const outcomes = on("f-outcome"), checks = D.checks.filter(c => on("f-check").has(c));
  const grid = document.getElementById("grid"); grid.replaceChildren();
  const head = el("tr"); head.appendChild(el("th", {}, "architecture"));
  checks.forEach(c => head.appendChild(el("th", {}, c))); grid.appendChild(el("thead")).appendChild(head);
  const body = grid.appendChild(el("tbody"));
  D.archs.forEach(a => {
    const cells = checks.map(c => byItem.get(`enginecheck::${a}::${c}`));
    if (!cells.some(r => r && outcomes.has(kind(r)))) return;
    const tr = el("tr"); tr.appendChild(el("th", {class: "arch"}, a));
    cells.forEach((r, i) => {
      if (!r) { tr.appendChild(el("td", {class: "none"}, "-")); return; }
      const id = `enginecheck::${a}::${checks[i]}`;
      const td = el("td", {class: `cell ${kind(r)}`, "data-item": id, title: r.message.split("\\n")[0]},
                    LABEL[kind(r)]);
      if (!outcomes.has(kind(r))) td.style.visibility = "hidden";
      td.addEventListener("click", () => { location.hash = "item=" + encodeURIComponent(id); });
      tr.appendChild(td); });
    body.appendChild(tr); });
  mark();
}
function bars(r) { const box = el("div");
  r.bars.forEach(b => { const total = b.parts.reduce((s, p) => s + p[1], 0), scale = Math.max(b.capacity || 0, total);
    box.appendChild(el("div", {class: "rank"}, `${r.arch} ${r.check} rank ${b.rank}: ${fmt(total)}` +
      (b.capacity ? ` of ${fmt(b.capacity)}` : "") + " (" + b.parts.map(p => `${p[0]} ${fmt(p[1])}`).join(", ") + ")"));
    const bar = box.appendChild(el("div", {class: "bar"}));
    b.parts.forEach(p => { const seg = bar.appendChild(el("div", {title: `${p[0]}: ${fmt(p[1])}`}));
      seg.style.width = (100 * p[1] / scale) + "%";
      seg.style.background = COLORS[D.categories.indexOf(p[0]) % COLORS.length]; }); });
  return box; }
function open(id) {
  const r = byItem.get(id), panel = document.getElementById("detail");
  if (!r) { panel.style.display = "none"; return; }
  panel.style.display = "block";
  document.getElementById("detail-title").textContent = id;
  const outcome = kind(r) === "dependency" ? "skipped (a root failed)" : r.outcome;
  document.getElementById("detail-outcome").textContent = `${outcome} in ${Number(r.duration_s).toFixed(3)} s`;
  document.getElementById("detail-message").textContent = r.message || "(no message)";
  document.getElementById("detail-bars").replaceChildren(bars(r));
  const phases = document.getElementById("detail-phases"); phases.replaceChildren();
  Object.entries(r.phases || {}).forEach(([k, v]) => { const tr = phases.appendChild(el("tr"));
    tr.append(el("td", {}, k), el("td", {}, Number(v).toFixed(4) + " s")); });
  document.getElementById("detail-json").textContent = JSON.stringify(r.detail, null, 2);
  mark();
}
function mark() { const id = current();
  document.querySelectorAll("td.cell").forEach(td => td.classList.toggle("open", td.dataset.item === id)); }
function current() { const m = location.hash.match(/^#item=(.*)$/); return m ? decodeURIComponent(m[1]) : null; }
D.categories.forEach((c, i) => { const s = el("span"); const sw = el("i");
  sw.style.background = COLORS[i % COLORS.length];
  s.append(sw, c); document.getElementById("legend").appendChild(s); });
const memory = document.getElementById("memory");
D.results.filter(r => r.bars.length).forEach(r => memory.appendChild(bars(r)));
if (!memory.children.length) memory.textContent = "(no budget items in this report)";
window.addEventListener("hashchange", () => open(current()));
draw(); open(current());
const click = location.hash.match(/^#click=(.*)$/);  // a link (or a headless browser) clicking a cell
if (click) [...document.querySelectorAll("td.cell")]
  .find(td => td.dataset.item === decodeURIComponent(click[1]))?.click();
</script></body></html>
"""
