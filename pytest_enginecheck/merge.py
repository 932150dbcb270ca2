"""Merge the JSON reports of sharded runs into the one report a single run would have written.

``python -m pytest_enginecheck.report merge SHARD.json... --json OUT.json [--junitxml OUT.xml] [--html OUT.html]
[--expect .test_durations] [--baseline OLD.json]``: the shards (``--enginecheck-json`` of each pytest-split group, or
of each CI machine) become one JSON report, one JUnit XML and one HTML page; the architecture x check table is
printed, an item reported by two shards or by none is called out, and the exit status is the one a single run would
have had (1 when a check failed or an item is missing, 5 when there are no results, 0 otherwise). With a baseline
(an earlier ``--enginecheck-json`` report of the same target) its regressions are printed and the HTML page lists
every change since it, regressions first (``report_diff.py``); the exit status does not depend on it.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import xml.etree.ElementTree as ET
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pytest_enginecheck.checks import CHECKS
from pytest_enginecheck.report import REPORT_VERSION, summary_mode, summary_table, write_json
from pytest_enginecheck.report_diff import Baseline, changes, changes_line, nodeid, plural

RESULT_KEYS = ("arch", "check", "outcome", "duration_s", "phases", "message", "detail")
OUTCOMES = ("passed", "failed", "skipped")
SEVERITY = {"passed": 0, "skipped": 1, "failed": 2}  # of two reports of one item, the merge keeps the worse
EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_EMPTY = 0, 1, 4, 5  # pytest's ExitCode values
_NOT_XML = re.compile("[^\t\n\r\x20-\ud7ff\ue000-\ufffd\U00010000-\U0010ffff]")  # characters XML 1.0 cannot hold


class MergeError(Exception):
    """A shard file that cannot be merged; the message names the file and what to change."""


def _order(result: dict[str, Any]) -> tuple[str, int, str]:
    base = result["check"].split("[")[0]
    return (result["arch"], CHECKS.index(base) if base in CHECKS else len(CHECKS), result["check"])


def read_shard(path: str | Path) -> tuple[str, list[dict[str, Any]]]:
    """A shard's target and results, validated (a file this version did not write is a MergeError)."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise MergeError(f"{path}: cannot read it as a JSON report ({e}); give the file --enginecheck-json wrote"
                         ) from None
    if not isinstance(data, dict) or data.get("version") != REPORT_VERSION:
        found = data.get("version") if isinstance(data, dict) else type(data).__name__
        raise MergeError(f"{path}: not an --enginecheck-json report of version {REPORT_VERSION} (found {found!r}); "
                         f"give the file --enginecheck-json wrote, from the same pytest-enginecheck version")
    results = data.get("results")
    if not isinstance(data.get("target"), str) or not isinstance(results, list):
        raise MergeError(f"{path}: a report needs a 'target' string and a 'results' list")
    for i, result in enumerate(results):
        if not isinstance(result, dict) or any(key not in result for key in RESULT_KEYS) \
                or result["outcome"] not in OUTCOMES:
            raise MergeError(f"{path}: results[{i}] is not a check result (it needs {', '.join(RESULT_KEYS)}, "
                             f"the outcome one of {', '.join(OUTCOMES)})")
    return data["target"], results


def expected_nodeids(path: str | Path) -> set[str]:
    """The check items a complete run has: the ``enginecheck::`` node ids of a pytest-split durations file (a
    JSON object keyed by node id), or of a text file with one node id a line."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as e:
        raise MergeError(f"--expect {path}: {e.strerror or e}; give the durations file (.test_durations)") from None
    try:
        ids: Iterable[str] = json.loads(text)
    except json.JSONDecodeError:
        ids = text.split()
    # pytest-xdist's --dist loadgroup appends "@group" to a node id
    return {i.split("@")[0] if i.rfind("@") > i.rfind("]") else i for i in ids
            if isinstance(i, str) and i.startswith("enginecheck::")}


@dataclass
class Merged:
    """The merged report and what the merge found wrong with the shards."""

    target: str
    results: list[dict[str, Any]]
    duplicates: dict[str, list[str]] = field(default_factory=dict)  # node id -> the files that reported it
    missing: list[str] = field(default_factory=list)  # node ids no shard reported

    @property
    def exit_status(self) -> int:
        """What a single run would have exited with: 1 if a check failed (or an item is missing), 5 if none ran."""
        if any(r["outcome"] == "failed" for r in self.results) or self.missing:
            return EXIT_FAILED
        return EXIT_OK if self.results else EXIT_EMPTY

    def notes(self) -> list[str]:
        """One line per item reported twice or not at all."""
        lines = [f"duplicate: {item} was reported by {len(files)} shards ({', '.join(files)}); the merge keeps the "
                 f"worst outcome" for item, files in sorted(self.duplicates.items())]
        lines += [f"missing: {item} was reported by no shard (a shard file not given, or a shard that did not run "
                  f"to the end)" for item in self.missing]
        return lines


def merge(paths: Sequence[str | Path], expect: set[str] | None = None) -> Merged:
    """Merge the shard files at ``paths``; ``expect``: the node ids a complete run has (see ``expected_nodeids``).

    An item is missing when ``expect`` names it, or when a merged check was folded into it (its ``root``), and no
    shard reported it.
    """
    if not paths:
        raise MergeError("no shard files given; pass the --enginecheck-json file of every shard")
    target: str | None = None
    kept: dict[str, dict[str, Any]] = {}
    files: dict[str, list[str]] = {}
    for path in paths:
        shard_target, results = read_shard(path)
        if target is not None and shard_target != target:
            raise MergeError(f"{path}: its target is {shard_target!r}, the others' {target!r}; merge the shards of "
                             f"one --enginecheck-target at a time")
        target = shard_target
        for result in results:
            item = nodeid(result)
            files.setdefault(item, []).append(str(path))
            if item not in kept or SEVERITY[result["outcome"]] > SEVERITY[kept[item]["outcome"]]:
                kept[item] = result
    roots = {r["detail"].get("root") for r in kept.values() if isinstance(r["detail"], dict)
             and r["detail"].get("kind") == "dependency"}
    wanted = (expect or set()) | {r for r in roots if isinstance(r, str)}
    assert target is not None
    return Merged(target, sorted(kept.values(), key=_order),
                  duplicates={item: where for item, where in files.items() if len(where) > 1},
                  missing=sorted(wanted - kept.keys()))


def read_baseline(path: str | Path, target: str) -> Baseline:
    """``--baseline``: an earlier report of ``target`` (a file that is not one is a MergeError naming the option)."""
    try:
        baseline_target, results = read_shard(path)
    except MergeError as e:
        raise MergeError(f"--baseline {e}") from None
    if baseline_target != target:
        raise MergeError(f"--baseline {path}: its target is {baseline_target!r}, the shards' {target!r}; give an "
                         f"earlier report of the same --enginecheck-target")
    return Baseline(str(path), results)


def baseline_lines(results: list[dict[str, Any]], baseline: Baseline) -> list[str]:
    """The count of changes since ``baseline`` and one line per regression (the HTML page lists every change)."""
    found = changes(results, baseline.results)
    regressions = [c for c in found if c.kind == "regression"]
    return [f"since the baseline {baseline.path}: {changes_line(found)}",
            *(f"  regression: {c.item}: {c.text}" for c in regressions)]


def _xml_text(text: str) -> str:
    return _NOT_XML.sub("\N{REPLACEMENT CHARACTER}", text)


def write_junit(path: str | Path, merged: Merged) -> None:
    """One JUnit XML for the merged run, as pytest's ``--junitxml`` writes it (classname ``enginecheck.<arch>``,
    name the check, the result as JSON in the ``enginecheck`` property)."""
    counts = {outcome: sum(r["outcome"] == outcome for r in merged.results) for outcome in OUTCOMES}
    suites = ET.Element("testsuites", name="pytest tests")
    suite = ET.SubElement(suites, "testsuite", name="pytest", errors="0", failures=str(counts["failed"]),
                          skipped=str(counts["skipped"]), tests=str(len(merged.results)),
                          time=f"{sum(float(r['duration_s']) for r in merged.results):.3f}")
    for result in merged.results:
        case = ET.SubElement(suite, "testcase", classname=f"enginecheck.{result['arch']}", name=result["check"],
                             time=f"{float(result['duration_s']):.3f}")
        properties = ET.SubElement(case, "properties")
        ET.SubElement(properties, "property", name="enginecheck", value=_xml_text(json.dumps(result)))
        message = _xml_text(result["message"])
        if result["outcome"] == "failed":
            ET.SubElement(case, "failure", message=message.split("\n")[0]).text = message
        elif result["outcome"] == "skipped":
            ET.SubElement(case, "skipped", type="pytest.skip", message=message).text = message
    for item in merged.missing:  # a missing item fails the merged run: say so where CI shows failures
        arch, check = item.split("::")[1:3]
        case = ET.SubElement(suite, "testcase", classname=f"enginecheck.{arch}", name=check, time="0")
        ET.SubElement(case, "error", message="reported by no shard").text = f"{item} was reported by no shard"
    if merged.missing:
        suite.set("errors", str(len(merged.missing)))
        suite.set("tests", str(len(merged.results) + len(merged.missing)))
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    ET.ElementTree(suites).write(path, encoding="utf-8", xml_declaration=True)


def parser() -> argparse.ArgumentParser:
    """``python -m pytest_enginecheck.report merge ...``."""
    p = argparse.ArgumentParser(prog="python -m pytest_enginecheck.report",
                                description="Merge the --enginecheck-json reports of sharded runs.")
    commands = p.add_subparsers(dest="command", required=True)
    m = commands.add_parser("merge", help="merge shard JSON files into one report (exit status: as one run's)")
    m.add_argument("shards", nargs="+", metavar="SHARD.json", help="the --enginecheck-json file of each shard")
    m.add_argument("--json", required=True, metavar="OUT.json", help="the merged JSON report")
    m.add_argument("--junitxml", metavar="OUT.xml", help="one JUnit XML for the merged run")
    m.add_argument("--html", metavar="OUT.html", help="the self-contained HTML report")
    m.add_argument("--expect", metavar="DURATIONS",
                   help="pytest-split's durations file (or node ids, one a line): its check items no shard "
                        "reported are missing")
    m.add_argument("--baseline", metavar="OLD.json",
                   help="an earlier --enginecheck-json report of the same target: print its regressions, and list "
                        "every change since it in the HTML page, regressions first")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Merge, print the table and what is wrong with the shards, write the outputs; return the exit status."""
    args = parser().parse_args(argv)
    try:
        merged = merge(args.shards, expected_nodeids(args.expect) if args.expect else None)
        baseline = read_baseline(args.baseline, merged.target) if args.baseline else None
    except MergeError as e:
        print(f"enginecheck merge: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    archs = len({r["arch"] for r in merged.results})
    for line in summary_table(merged.results, summary_mode(None, archs)) if merged.results else ["no results"]:
        print(line)
    for line in merged.notes():
        print(line)
    for line in baseline_lines(merged.results, baseline) if baseline else []:
        print(line)
    write_json(args.json, merged.target, merged.results)
    if args.junitxml:
        write_junit(args.junitxml, merged)
    if args.html:
        from pytest_enginecheck.html_report import write_html

        write_html(args.html, merged.target, merged.results, merged.notes(), baseline)
    print(f"merged {plural(len(args.shards), 'shard')}: {plural(len(merged.results), 'item')} of target "
          f"{merged.target!r}; exit status {merged.exit_status}")
    return merged.exit_status
