"""The summary table (architecture x check), the ModelInfo cache line, the import profiles and the JSON report."""

from __future__ import annotations

import json
import os
import re
import textwrap
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pytest_enginecheck.checks import CHECKS

REPORT_VERSION = 1
_CELL = {"passed": "ok", "failed": "FAIL", "skipped": "skip"}
# The narrow table's marks, one per item (pytest's progress letters); NOT_RUN where an item did not run.
MARKS = {"passed": ".", "failed": "F", "skipped": "s"}
NOT_RUN = "-"
PLUGIN_ROW = "plugin:"  # the prefix of the plugins check's rows
LARGE = 400  # architectures from which the table lists failures first (and, by default, only them)
# engine_ref.model_executor.models.registry.CACHE_OUTCOMES: a result's detail["cache"] counts lookups by these
CACHE_OUTCOMES = ("memory", "disk", "missing", "source_changed", "format_version", "no_source", "corrupt")
# Why a lookup inspected the class (no usable entry), as the cache line words it
_STALE = {"missing": "not cached yet", "source_changed": "source changed", "format_version": "older cache format",
          "no_source": "no source file"}
CACHE_WHAT = "ModelInfo cache (the registry's saved inspection of each class)"


def _check_order(check: str) -> tuple[int, str]:
    base = check.split("[")[0]
    return (CHECKS.index(base) if base in CHECKS else len(CHECKS), check)


def fit(line: str, width: int | None) -> list[str]:
    """``line`` wrapped at word boundaries to ``width`` columns (continuation lines indented), or as it is."""
    if width is None or len(line) <= width:
        return [line]
    return textwrap.wrap(line, width, subsequent_indent="  ", break_long_words=False, break_on_hyphens=False)


def pack(prefix: str, parts: list[str], width: int | None) -> list[str]:
    """``parts`` joined by ", " into as few lines of ``width`` columns as they fit, each line starting with
    ``prefix`` (a part is never split)."""
    lines: list[str] = []
    line = ""
    for part in parts:
        joined = f"{line}, {part}" if line else part
        if line and width is not None and len(prefix) + len(joined) > width:
            lines.append(prefix + line)
            joined = part
        line = joined
    return [*lines, prefix + line]


def summary_mode(requested: str | None, architectures: int) -> str:
    """``--enginecheck-summary`` as given, else all rows below LARGE architectures and failures from there."""
    return requested or ("all" if architectures < LARGE else "failures")


def summary_table(results: list[dict[str, Any]], mode: str = "all", others: Mapping[str, int] | None = None,
                  width: int | None = None) -> list[str]:
    """Rows of architectures, columns of checks in CHECKS order ('-' where a check did not run), then the counts.

    ``mode`` "failures" lists only the rows with a failure, "all" every row (those with a failure first
    from LARGE architectures). ``others``: pytest's counts of the other tests that ran, so that the two
    lines together agree with pytest's own. ``width``: the terminal's columns; a table wider than that
    gets a column per check instead of per item, a mark per item in it (``narrow_grid``), and every line
    is wrapped to it (None: no limit).
    """
    archs = sorted({r["arch"] for r in results})
    failing = {r["arch"] for r in results if r["outcome"] == "failed"}
    shown = [a for a in archs if a in failing] if mode == "failures" else archs
    if mode == "all" and len(archs) >= LARGE:
        shown = [a for a in archs if a in failing] + [a for a in archs if a not in failing]
    checks = sorted({r["check"] for r in results}, key=_check_order)
    outcomes = {(r["arch"], r["check"]): r["outcome"] for r in results}
    lines = wide_grid(shown, checks, outcomes) if shown else []
    if width is not None and any(len(line) > width for line in lines):
        lines = narrow_grid(shown, checks, outcomes, width)
    prose: list[str] = []
    if len(shown) < len(archs):
        prose.append(f"({len(archs) - len(shown)} architectures without a failure not shown; "
                     f"--enginecheck-summary=all lists them)")
    counts = {outcome: sum(r["outcome"] == outcome for r in results) for outcome in _CELL}
    dependent = sum(r["outcome"] == "skipped" and r["detail"].get("kind") == "dependency" for r in results)
    because = f" ({dependent} because a check they depend on failed)" if dependent else ""
    plugins = sum(a.startswith(PLUGIN_ROW) for a in archs)  # the plugins check's rows: enginecheck::plugin:<name>
    subjects = f"{len(archs) - plugins} architecture{'s' if len(archs) - plugins != 1 else ''}" + (
        f" and {plugins} plugin{'s' if plugins != 1 else ''}" if plugins else "")
    line = (f"{subjects}: {counts['passed']} passed, {counts['failed']} failed, "
            f"{counts['skipped']} skipped{because}")
    rest = ", ".join(f"{n} {outcome}" for outcome, n in (others or {}).items() if n)
    prose.append(f"{line}; other tests: {rest}" if rest else line)
    prose.extend(skip_lines(results))
    prose.extend(oracle_lines(results))
    unknown = cache_unknown(results)
    if any(isinstance(r["detail"].get("cache"), dict) for r in results):
        prose.append(cache_line(cache_totals(results), unknown))
    elif unknown:
        prose.append(cache_line(None, unknown))
    return lines + [part for text in prose for part in fit(text, width)]


def wide_grid(archs: list[str], checks: list[str], outcomes: Mapping[tuple[str, str], str]) -> list[str]:
    """A column per item (``load[tp=2]``), a word per cell: ok, FAIL, skip, or '-' where the item did not run."""
    arch_width = max(len("architecture"), *(len(a) for a in archs))
    widths = [max(len(c), 4) for c in checks]
    header = f"{'architecture':<{arch_width}}  " + "  ".join(f"{c:<{w}}" for c, w in zip(checks, widths, strict=True))
    lines = [header, "-" * len(header)]
    for arch in archs:
        lines.append(f"{arch:<{arch_width}}  " + "  ".join(
            f"{_CELL.get(outcomes.get((arch, c), ''), '-'):<{w}}" for c, w in zip(checks, widths, strict=True)))
    return lines


def narrow_grid(archs: list[str], checks: list[str], outcomes: Mapping[tuple[str, str], str], width: int
                ) -> list[str]:
    """A column per check (``load``), in it a mark per item in the items' order (``.F``: tp=1 passed, tp=2 failed),
    then the legend; an architecture name too long for its column gets a line of its own above its marks."""
    families: dict[str, list[str]] = {}
    for check in checks:
        families.setdefault(check.split("[")[0], []).append(check)
    marks = {arch: ["".join(MARKS.get(outcomes.get((arch, c), ""), NOT_RUN) for c in items)
                    for items in families.values()] for arch in archs}
    widths = [max(len(name), len(items)) for name, items in families.items()]
    longest = max(len("architecture"), *(len(a) for a in archs))
    for sep in ("  ", " "):  # one space between columns only where two do not fit
        columns = sum(widths) + len(sep) * len(widths)
        if longest + columns <= width:
            break
    arch_width = max(len("architecture"), min(longest, width - columns))

    def row(name: str, cells: list[str]) -> str:
        return (f"{name:<{arch_width}}{sep}" + sep.join(f"{c:<{w}}" for c, w in zip(cells, widths, strict=True))
                ).rstrip()

    header = row("architecture", list(families))
    lines = [header, "-" * len(header)]
    for arch in archs:
        lines.extend([arch, row("", marks[arch])] if len(arch) > arch_width else [row(arch, marks[arch])])
    return lines + fit(legend(families), width)


def legend(families: Mapping[str, list[str]]) -> str:
    """What the narrow table's marks mean and, for a check of several items, which item each mark is: ``. passed,
    F failed, s skipped, - not run; a mark per item: load, budget tp=1,2; quant fp8 tp=1,2, int8 tp=1,2``."""
    by_items: dict[str, list[str]] = {}  # the items' words -> the checks that have those items
    for name, items in families.items():
        if items != [name]:  # several items, or one with a parameter (load[tp=2] alone)
            by_items.setdefault(_items_words(name, items), []).append(name)
    each = "; ".join(f"{', '.join(names)} {words}" for words, names in by_items.items())
    return f"{MARKS['passed']} passed, {MARKS['failed']} failed, {MARKS['skipped']} skipped, {NOT_RUN} not run" + (
        f"; a mark per item: {each}" if each else "")


def _items_words(name: str, items: list[str]) -> str:
    """``tp=1,2`` for load[tp=1], load[tp=2]; ``fp8 tp=1,2, int8 tp=1,2`` for quant[fp8,tp=1]...; else the items'
    parameters as they are (``[a] [b]``)."""
    params = [item[len(name) + 1:-1] for item in items]
    by_prefix: dict[str, list[str]] = {}
    for param in params:
        found = re.fullmatch(r"(?:(.+),)?tp=(\d+)", param)
        if found is None:
            return " ".join(f"[{p}]" for p in params)
        by_prefix.setdefault(found.group(1) or "", []).append(found.group(2))
    return ", ".join(f"{prefix} tp={','.join(sizes)}".strip() for prefix, sizes in by_prefix.items())


ORACLE_ITEM = "load[tp=1]"  # the item whose detail says what the model's output was compared with
ORACLE_WORDS = {"reference": "against a reference implementation (transformers' class of its name, or as named)",
                "self": "self-consistency only (two seeds, KV cache against recomputing, TP sizes)",
                "none": "compared with nothing (built, loaded and generated)"}
LORA_ORACLE_ITEM = "lora[tp=1]"  # its detail says what the output with and without an adapter was compared with
# The items whose detail records ``oracle``, each with the words of its kinds, in the summary's order.
ORACLE_ITEMS: dict[str, dict[str, str]] = {
    ORACLE_ITEM: ORACLE_WORDS,
    LORA_ORACLE_ITEM: {"reference": "against a reference implementation with PEFT's adapter (transformers' class "
                                    "of its name, or as named)",
                       "self": "self-consistency only (with and without the adapter, TP sizes)",
                       "none": "compared with nothing (built, loaded and generated)"},
}
NAMED = 4  # architectures named per oracle kind before "and N more"


SKIP_REASON_CHARS = 160  # of a skip's reason in its summary line


def skip_reason(result: dict[str, Any]) -> str:
    """A skip's reason as its group in the summary: its message's first line, the architecture's name left out."""
    first = (result.get("message", "").splitlines() or [""])[0].replace(result["arch"], "<architecture>")
    return first if len(first) <= SKIP_REASON_CHARS else first[: SKIP_REASON_CHARS - 3] + "..."


def skip_lines(results: list[dict[str, Any]]) -> list[str]:
    """One line per reason the run skipped items for (the most items first), naming their architectures: a skip is
    never a silent green, with or without -rs. Skips because a check they depend on failed are counted above."""
    groups: dict[str, list[dict[str, Any]]] = {}
    for r in results:
        if r["outcome"] == "skipped" and r["detail"].get("kind") != "dependency":
            groups.setdefault(skip_reason(r), []).append(r)
    return [f"skipped {len(group)}: {reason} ({_named(sorted({r['arch'] for r in group}))})"
            for reason, group in sorted(groups.items(), key=lambda kv: (-len(kv[1]), kv[0]))]


def _named(names: list[str]) -> str:
    more = f" and {len(names) - NAMED} more" if len(names) > NAMED else ""
    return ", ".join(names[:NAMED]) + more


def oracle_lines(results: list[dict[str, Any]]) -> list[str]:
    """What each item of ORACLE_ITEMS held each architecture's output to (its detail's ``oracle``), a line per item
    that recorded one: a reference implementation (named), self-consistency only, or nothing."""
    return [line for item, words in ORACLE_ITEMS.items() if (line := oracle_line(results, item, words))]


def oracle_line(results: list[dict[str, Any]], item: str = ORACLE_ITEM,
                words: Mapping[str, str] = ORACLE_WORDS) -> str | None:
    """What ``item`` held each architecture's output to (its detail's ``oracle``), in ``words`` by kind: a reference
    implementation (named), self-consistency only, or nothing; None where no result of ``item`` says."""
    by_kind: dict[str, list[str]] = {}
    for r in sorted(results, key=lambda r: r["arch"]):
        kind = r["detail"].get("oracle") if r["check"] == item else None
        if isinstance(kind, str) and kind in words:
            reference = r["detail"].get("reference")
            own = reference in (None, f"transformers' {r['arch']}")  # its own name's: said once, in the words
            by_kind.setdefault(kind, []).append(r["arch"] if own else f"{r['arch']} ({reference})")
    if not by_kind:
        return None
    parts = [f"{len(names)} {words[kind]}: {_named(names)}" for kind in words if (names := by_kind.get(kind))]
    return f"{item} oracle: " + "; ".join(parts)


def cache_unknown(results: list[dict[str, Any]]) -> list[str]:
    """Why the cache's outcome of some lookups is unknown: the results whose ``detail["cache"]`` is a sentence
    instead of counts (a target that cannot read its engine's cache), each reason once."""
    return list(dict.fromkeys(r["detail"]["cache"] for r in results if isinstance(r["detail"].get("cache"), str)))


def cache_totals(results: list[dict[str, Any]]) -> dict[str, int]:
    """The ModelInfo lookups of the run by outcome (CACHE_OUTCOMES): each result's ``detail["cache"]``, summed."""
    totals = dict.fromkeys(CACHE_OUTCOMES, 0)
    for r in results:
        counts = r["detail"].get("cache")
        if isinstance(counts, dict):
            for outcome in CACHE_OUTCOMES:
                totals[outcome] += int(counts.get(outcome, 0))
    return totals


def cache_line(totals: dict[str, int] | None, unknown: list[str] | None = None) -> str:
    """Whether the registry answered the run's ModelInfo lookups from its cache or inspected the class, e.g.
    ``ModelInfo cache (...): 413 lookups answered from it (3 in memory, 410 on disk), 2 inspected the class
    (1 not cached yet, 1 source changed), 0 found a corrupt entry``.

    A lookup no usable entry answered inspects the class, counted by reason; one that found a corrupt entry inspects
    it too, counted apart. ``unknown``: why some lookups cannot be told (``cache_unknown``), appended; ``totals``
    None: why none can.
    """
    cannot = "; ".join(unknown or ())
    if totals is None:
        return f"{CACHE_WHAT}: cannot tell whether it answered the lookups or the classes were inspected: {cannot}"
    reasons = [f"{totals[k]} {words}" for k, words in _STALE.items() if totals.get(k)]
    inspected = sum(totals.get(k, 0) for k in _STALE)
    why = f" ({', '.join(reasons)})" if reasons else ""
    memory, disk = totals.get("memory", 0), totals.get("disk", 0)
    line = (f"{CACHE_WHAT}: {memory + disk} lookup{'s' if memory + disk != 1 else ''} answered from it "
            f"({memory} in memory, {disk} on disk), "
            f"{inspected} inspected the class{why}, {totals.get('corrupt', 0)} found a corrupt entry")
    return f"{line}; cannot tell for the others: {cannot}" if cannot else line


def _import_results(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The import checks' results that carry ``detail["import_profile"]``, by architecture."""
    profiled = [r for r in results if r["check"] == "import" and isinstance(r["detail"].get("import_profile"), list)]
    return sorted(profiled, key=lambda r: r["arch"])


def _module_line(entry: dict[str, Any]) -> str:
    chain = entry.get("chain") or []
    via = f"  (chain: {' -> '.join(chain)})" if len(chain) > 1 else ""
    return f"  {entry['self_s']:8.3f} s  {entry['cumulative_s']:8.3f} s  {entry['module']}{via}"


def import_profile_lines(results: list[dict[str, Any]], top: int) -> list[str]:
    """``--enginecheck-import-profile=N``: per architecture the ``top`` modules its import spent the most self
    time in (with their cumulative time and the chain that pulled each in), then the modules that cost the
    most summed over every architecture of the run: what a preload or a lazy import would save."""
    lines: list[str] = []
    summed: dict[str, tuple[float, int]] = {}  # module -> (self seconds summed, architectures)
    profiled = _import_results(results)
    for r in profiled:
        profile = r["detail"]["import_profile"]
        seconds = r["detail"].get("import_seconds", r["phases"].get("check"))
        took = f" took {seconds:.3f} s" if isinstance(seconds, (int, float)) else ""
        failed = " (failed)" if r["outcome"] == "failed" else ""
        lines.append(f"{r['arch']}: importing its module{took}{failed}; slowest modules (self, cumulative):")
        lines.extend(_module_line(entry) for entry in profile[:top])
        for entry in profile:
            total, archs = summed.get(entry["module"], (0.0, 0))
            summed[entry["module"]] = (total + entry["self_s"], archs + 1)
    if summed:
        lines.append(f"Modules that cost the most summed over {len(profiled)} architecture"
                     f"{'s' if len(profiled) != 1 else ''} (self time, from each import's slowest modules):")
        ranked = sorted(summed.items(), key=lambda item: (-item[1][0], item[0]))[:top]
        lines.extend(f"  {total:8.3f} s  {module}  (imported by {archs} architecture{'s' if archs != 1 else ''})"
                     for module, (total, archs) in ranked)
    return lines


def write_json(path: str | Path, target: str, results: list[dict[str, Any]]) -> None:
    """``{"version": 1, "target": ..., "cache": {...}, "results": [...]}``, written atomically (no temp file is
    left behind); ``cache``: the run's ModelInfo lookups by outcome (``cache_totals``), and under
    ``"cannot_tell"`` why some could not be told (``cache_unknown``), when any could not."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        unknown = cache_unknown(results)
        cache: dict[str, Any] = {**cache_totals(results), **({"cannot_tell": unknown} if unknown else {})}
        report = {"version": REPORT_VERSION, "target": target, "cache": cache, "results": results}
        tmp.write_text(json.dumps(report, indent=2) + "\n")
        tmp.replace(path)
    finally:
        tmp.unlink(missing_ok=True)


if __name__ == "__main__":  # python -m pytest_enginecheck.report merge SHARD.json... (see merge.py)
    import sys

    from pytest_enginecheck.merge import main

    sys.exit(main())
