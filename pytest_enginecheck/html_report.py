"""The self-contained HTML report (``--enginecheck-html=PATH``, and ``merge --html``): one file, nothing fetched.

An architecture x check grid coloured by outcome (architectures with a failure first), filtered by check and
outcome, scrolling inside its box with the architecture column and the header row fixed; a cell opens its message,
failure detail (compact JSON) and phase timings (so does the URL fragment ``#item=enginecheck::<arch>::<check>``;
``#click=...`` clicks that cell); the budget items' per-rank memory as bars of the model's own categories (weights,
buffers, activation peak, LoRA, vLLM's one request of KV) on a scale where each is visible, the KV cache (which fills
what is left) as a number. With a baseline (``merge --baseline OLD.json``) the page lists what changed since it,
regressions first, marks the changed cells and draws each budget rank's baseline bar under its own, on one scale.
The results travel as JSON inside the page and its inline script draws it (named ``html_report``, not ``html``:
this module uses the standard library's ``html``).
"""

from __future__ import annotations

import html
import json
import os
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from engine_ref.utils import format_bytes
from pytest_enginecheck.checks import CHECKS
from pytest_enginecheck.report_diff import (
    KV,
    OWN,
    Baseline,
    changes,
    changes_line,
    nodeid,
    outcome_kind,
    own_parts,
    plural,
    ranks,
)

_UNITS = {"": 1, "B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40, "KB": 10**3, "MB": 10**6,
          "GB": 10**9, "TB": 10**12}
OUTCOMES = ("failed", "dependency", "skipped", "passed")  # the page's outcomes; dependency: skipped, a root failed


def _size(text: object) -> int | None:
    match = re.fullmatch(r"\s*([0-9.]+)\s*([KMGT]i?B|B)?\s*", str(text)) if text is not None else None
    return int(float(match[1]) * _UNITS[match[2] or ""]) if match else None


def _widths(parts: list[tuple[str, int]], scale: int) -> list[tuple[str, int, float]]:
    return [(label, size, round(100 * size / scale, 3)) for label, size in parts]


def memory_bars(result: dict[str, Any], was: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """Per rank of a budget result: the model's own categories as (label, bytes, width in %) on one scale for every
    rank of the item and of ``was`` (its baseline result): the largest sum of them is 100 %, so a category 10 %
    larger is drawn 10 % longer. ``was``: the baseline's parts of that rank (None without one); ``rest``: the KV
    cache (engine_ref's fills what the capacity leaves; vLLM's is what it allocated) and the capacity, in words."""
    now, before = ranks(result), dict(ranks(was)) if was else {}
    scale = max((sum(size for _, size in own_parts(m)) for m in [m for _, m in now] + [*before.values()]),
                default=0) or 1
    budget = _size(result["detail"].get("budget"))
    bars = []
    for rank, memory in now:
        capacity = memory["capacity"] if isinstance(memory.get("capacity"), int) else budget
        kv = next(((label, memory[key]) for key, label in KV if isinstance(memory.get(key), int)), None)
        kv_words = f"{kv[0]}: {format_bytes(kv[1])}" if kv else ""
        of = f"capacity {format_bytes(capacity)}" if capacity else ""
        part_of_capacity = kv is not None and kv[0] == "KV cache" and capacity  # engine_ref's: "X of capacity Y"
        rest = f"{kv_words} of {of}" if part_of_capacity else "; ".join(words for words in (kv_words, of) if words)
        bars.append({"rank": rank, "capacity": capacity, "rest": rest,
                     "parts": _widths(own_parts(memory), scale),
                     "was": _widths(own_parts(before[rank]), scale) if rank in before else None})
    return bars


def compact_json(value: Any, indent: int = 2, level: int = 0) -> str:
    """``value`` as ``json.dumps(value, indent=indent)`` writes it, but a list of scalars (a token list, sizes per
    rank) on one line, as are an empty list and an empty object."""
    scalars = isinstance(value, list) and not any(isinstance(v, (list, dict)) for v in value)
    if not isinstance(value, (list, dict)) or not value or scalars:
        return json.dumps(value, ensure_ascii=False, separators=(", ", ": "))
    inner, pad = " " * indent * (level + 1), " " * indent * level
    lines = ([f"{inner}{json.dumps(str(k), ensure_ascii=False)}: {compact_json(v, indent, level + 1)}"
              for k, v in value.items()] if isinstance(value, dict)
             else [f"{inner}{compact_json(v, indent, level + 1)}" for v in value])
    opening, closing = "{}" if isinstance(value, dict) else "[]"
    return opening + "\n" + ",\n".join(lines) + "\n" + pad + closing


def counts_line(results: Sequence[dict[str, Any]]) -> str:
    """``2 architectures, 26 items: 0 failed, 0 skipped (a root failed), 0 skipped, 26 passed``."""
    kinds = [outcome_kind(r) for r in results]
    counts = ", ".join(f"{kinds.count(o)} {'skipped (a root failed)' if o == 'dependency' else o}" for o in OUTCOMES)
    return f"{plural(len({r['arch'] for r in results}), 'architecture')}, {plural(len(results), 'item')}: {counts}"


def _check_order(check: str) -> tuple[int, str]:
    base = check.split("[")[0]
    return (CHECKS.index(base) if base in CHECKS else len(CHECKS), check)


def render(target: str, results: Sequence[dict[str, Any]], notes: Sequence[str] = (),
           baseline: Baseline | None = None) -> str:
    """The page for ``results`` (the ``--enginecheck-json`` results) of ``target``; ``notes``: lines shown above
    the grid (a merge's duplicate and missing items); ``baseline``: an earlier report to list the changes since."""
    archs = sorted({r["arch"] for r in results})
    failing = {r["arch"] for r in results if r["outcome"] == "failed"}
    was = {nodeid(r): r for r in baseline.results} if baseline else {}
    found = changes(results, baseline.results) if baseline else []
    data = {
        "target": target,
        "counts": counts_line(results),
        "archs": [a for a in archs if a in failing] + [a for a in archs if a not in failing],
        "checks": sorted({r["check"] for r in results}, key=_check_order),
        "results": [{**r, "bars": memory_bars(r, was.get(nodeid(r))), "detail_text": compact_json(r["detail"])}
                    for r in results],
        "notes": list(notes),
        "categories": [label for _, label in OWN],
        "baseline": {"path": baseline.path, "summary": changes_line(found),
                     "changes": [c.to_dict() for c in found]} if baseline else None,
    }
    payload = json.dumps(data).replace("<", "\\u003c")  # nothing in it can close the script element
    title = html.escape(f"enginecheck: {target}")
    return _PAGE.replace("__TITLE__", title).replace("__DATA__", payload)


def write_html(path: str | Path, target: str, results: Sequence[dict[str, Any]], notes: Sequence[str] = (),
               baseline: Baseline | None = None) -> None:
    """Write the page atomically (no temp file is left behind)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(render(target, results, notes, baseline), encoding="utf-8")
        tmp.replace(path)
    finally:
        tmp.unlink(missing_ok=True)


_PAGE = """<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>__TITLE__</title>
<meta name="viewport" content="width=device-width, initial-scale=1">
<style>
body{font:14px/1.4 system-ui,sans-serif;margin:16px;color:#1d1d1f;background:#fff}
h1{font-size:20px;margin:0 0 4px}h2{font-size:16px;margin:18px 0 6px}.note{color:#a00}
fieldset{display:inline-block;border:1px solid #ccc;margin:6px 8px 6px 0;padding:4px 8px}
fieldset label{margin-right:8px;white-space:nowrap}
#grid-box{overflow:auto;width:fit-content;max-width:100%;max-height:75vh;margin-top:8px;border:1px solid #ccc}
table.grid{border-collapse:separate;border-spacing:0}
.grid th,.grid td{border:0 solid #ddd;border-width:0 1px 1px 0;padding:3px 6px;text-align:center;white-space:nowrap}
.grid th.arch{position:sticky;left:0;z-index:1;background:#fff;text-align:left;font-weight:normal;
  font-family:ui-monospace,monospace;border-right-color:#aaa}
.grid thead th{position:sticky;top:0;z-index:2;background:#f4f4f6;font-family:ui-monospace,monospace;font-size:12px}
.grid thead th:first-child{left:0;z-index:3;border-right-color:#aaa}
td.cell{cursor:pointer;font-weight:600;font-size:12px}
td.passed{background:#d6f5dd;color:#14532d}td.failed{background:#f8c9c9;color:#7f1d1d}
td.skipped{background:#eceff3;color:#555}td.dependency{background:#fde7c2;color:#7a4b00}
td.none{color:#bbb}td.open{outline:3px solid #1f6feb;outline-offset:-3px}
td.worse{box-shadow:inset 0 0 0 2px #b42318}td.worse::after{content:" \\25B2";color:#b42318}
td.better{box-shadow:inset 0 0 0 2px #15803d}td.better::after{content:" \\25BC";color:#15803d}
#changes ol{max-height:16em;overflow:auto;margin:4px 0;padding:0;list-style:none;font-size:13px}
#changes a{font-family:ui-monospace,monospace;margin-right:6px}
.kind{display:inline-block;min-width:7.5em;margin-right:6px;font-weight:600}
.k-regression{color:#b42318}.k-improvement{color:#15803d}.k-new,.k-removed,.k-changed{color:#555}
#detail{border:1px solid #ccc;border-radius:6px;padding:8px 12px;margin-top:12px;display:none}
#detail pre{white-space:pre-wrap;word-break:break-word;background:#f7f7f9;padding:8px;max-height:28em;overflow:auto}
#detail table td{padding:1px 10px 1px 0;font-family:ui-monospace,monospace}
.bar{display:flex;height:16px;border:1px solid #999;width:520px;max-width:100%;background:#fff;margin:2px 0}
.bar.was{height:7px;opacity:.55;margin-bottom:8px}
.bar div{height:100%}.rank{font-family:ui-monospace,monospace;font-size:12px}.rank.was{color:#666}
.legend span{display:inline-block;margin-right:10px}.scale{color:#555;font-size:12px}
.legend i{display:inline-block;width:10px;height:10px;margin-right:3px}
</style></head><body>
<h1 id="title"></h1><div id="counts"></div><div id="notes"></div>
<section id="changes" hidden><h2 id="changes-title"></h2><ol id="changes-list"></ol></section>
<div><fieldset id="f-outcome"><legend>outcome</legend></fieldset>
<fieldset id="f-check"><legend>check</legend></fieldset></div>
<div id="grid-box"><table class="grid" id="grid"></table></div>
<section id="detail"><h2 id="detail-title"></h2><div id="detail-outcome"></div><ul id="detail-changes"></ul>
<pre id="detail-message"></pre><div id="detail-bars"></div><h2>phase timings</h2><table id="detail-phases"></table>
<h2>detail</h2><pre id="detail-json"></pre></section>
<h2>memory per rank (budget items)</h2><div class="legend" id="legend"></div>
<div class="scale">Each bar is the model's own memory, scaled to the largest rank of its item (and of its baseline):
the KV cache fills what the capacity leaves, so it is written beside, not drawn.</div><div id="memory"></div>
<script type="application/json" id="data">__DATA__</script>
<script>
"use strict";
const D = JSON.parse(document.getElementById("data").textContent);
const COLORS = ["#4e79a7", "#9c755f", "#f28e2b", "#e15759", "#76b7b2"];
const OUTCOMES = ["failed", "dependency", "skipped", "passed"];
const byItem = new Map(D.results.map(r => [`enginecheck::${r.arch}::${r.check}`, r]));
const changesBy = new Map();
(D.baseline ? D.baseline.changes : []).forEach(c => {
  if (!changesBy.has(c.item)) changesBy.set(c.item, []); changesBy.get(c.item).push(c); });
const kind = r => r.outcome === "skipped" && r.detail && r.detail.kind === "dependency" ? "dependency" : r.outcome;
const LABEL = {passed: "ok", failed: "FAIL", skipped: "skip", dependency: "skip"};
const el = (tag, attrs = {}, text) => { const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) e.setAttribute(k, v);
  if (text !== undefined) e.textContent = text; return e; };
const fmt = b => b >= 2 ** 30 ? (b / 2 ** 30).toFixed(2) + " GiB" : b >= 2 ** 20 ? (b / 2 ** 20).toFixed(2) + " MiB"
  : b >= 2 ** 10 ? (b / 2 ** 10).toFixed(2) + " KiB" : b + " B";
document.getElementById("title").textContent = document.title;
document.getElementById("counts").textContent = D.counts;
D.notes.forEach(n => document.getElementById("notes").appendChild(el("div", {class: "note"}, n)));
if (D.baseline) { document.getElementById("changes").hidden = false;
  document.getElementById("changes-title").textContent =
    `Changes since the baseline ${D.baseline.path}: ${D.baseline.summary}`;
  const list = document.getElementById("changes-list");
  D.baseline.changes.forEach(c => list.appendChild(el("li")).append(el("span", {class: `kind k-${c.kind}`}, c.kind),
    el("a", {href: "#item=" + encodeURIComponent(c.item)}, c.item), c.text)); }
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
      const id = `enginecheck::${a}::${checks[i]}`, since = changesBy.get(id) || [];
      const moved = since.some(c => c.kind === "regression") ? " worse"
        : since.some(c => c.kind === "improvement") ? " better" : "";
      const td = el("td", {class: `cell ${kind(r)}${moved}`, "data-item": id,
                           title: [r.message.split("\\n")[0], ...since.map(c => c.text)].join("\\n")},
                    LABEL[kind(r)]);
      if (!outcomes.has(kind(r))) td.style.visibility = "hidden";
      td.addEventListener("click", () => { location.hash = "item=" + encodeURIComponent(id); });
      tr.appendChild(td); });
    body.appendChild(tr); });
  mark();
}
function bar(parts, cls) { const b = el("div", {class: cls});
  parts.forEach(p => { const seg = b.appendChild(el("div", {title: `${p[0]}: ${fmt(p[1])} (${p[1]} bytes)`}));
    seg.style.width = p[2] + "%"; seg.style.background = COLORS[D.categories.indexOf(p[0]) % COLORS.length]; });
  return b; }
const words = parts => fmt(parts.reduce((s, p) => s + p[1], 0)) + " (" +
  parts.map(p => `${p[0]} ${fmt(p[1])}`).join(", ") + ")";
function bars(r) { const box = el("div");
  r.bars.forEach(b => {
    box.appendChild(el("div", {class: "rank"}, `${r.arch} ${r.check} rank ${b.rank}: model's own ${words(b.parts)}` +
      (b.rest ? `; ${b.rest}` : "")));
    box.appendChild(bar(b.parts, "bar"));
    if (b.was) box.append(el("div", {class: "rank was"}, `baseline: ${words(b.was)}`), bar(b.was, "bar was")); });
  return box; }
function open(id) {
  const r = byItem.get(id), panel = document.getElementById("detail");
  if (!r) { panel.style.display = "none"; return; }
  panel.style.display = "block";
  document.getElementById("detail-title").textContent = id;
  const outcome = kind(r) === "dependency" ? "skipped (a root failed)" : r.outcome;
  document.getElementById("detail-outcome").textContent = `${outcome} in ${Number(r.duration_s).toFixed(3)} s`;
  document.getElementById("detail-changes").replaceChildren(...(changesBy.get(id) || []).map(c =>
    el("li", {class: `k-${c.kind}`}, `since the baseline, ${c.kind}: ${c.text}`)));
  document.getElementById("detail-message").textContent = r.message || "(no message)";
  document.getElementById("detail-bars").replaceChildren(bars(r));
  const phases = document.getElementById("detail-phases"); phases.replaceChildren();
  Object.entries(r.phases || {}).forEach(([k, v]) => { const tr = phases.appendChild(el("tr"));
    tr.append(el("td", {}, k), el("td", {}, Number(v).toFixed(4) + " s")); });
  document.getElementById("detail-json").textContent = r.detail_text;
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
