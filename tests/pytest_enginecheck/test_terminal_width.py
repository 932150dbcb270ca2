"""What a run prints fits the terminal (pytest's own width): the summary table keeps a column per item where that
fits and a column per check with a mark per item where it does not, the header says target, checks, TP sizes and
budget in two short lines (every setting with -v), and the summary counts only the other tests that ran."""

from __future__ import annotations

import pytest

from pytest_enginecheck.report import MARKS, NOT_RUN, summary_table

BUNDLED = ["LlamaForCausalLM", "LlavaForConditionalGeneration", "MixtralForCausalLM", "Qwen2ForCausalLM",
           "Qwen3MoeForCausalLM"]
# the main job's items on engine_ref: a table of them with a column each is 201 columns wide
ITEMS = ["import", "inspect", "load[tp=1]", "load[tp=2]", "budget[tp=1]", "budget[tp=2]", "startup", "lora[tp=1]",
         "lora[tp=2]", "quant[fp8,tp=1]", "quant[fp8,tp=2]", "quant[int8,tp=1]", "quant[int8,tp=2]"]
LONG = "Qwen3OmniMoeThinkerForConditionalGeneration"  # a vLLM name: 43 characters


def main_job(*extra: tuple[str, str, str]) -> list[dict[str, object]]:
    """The main job's results: Llava's lora and quant items skip, Mixtral's load[tp=2] fails; ``extra`` rows."""
    outcomes = {(arch, item): "skipped" if arch.startswith("Llava") and item[:4] in ("lora", "quan") else "passed"
                for arch in BUNDLED for item in ITEMS}
    outcomes["MixtralForCausalLM", "load[tp=2]"] = "failed"
    outcomes.update({(arch, item): outcome for arch, item, outcome in extra})
    return [{"arch": arch, "check": item, "outcome": outcome, "detail": {},
             "message": f"{arch}: no LoRA" if outcome == "skipped" else ""}
            for (arch, item), outcome in outcomes.items()]


def legend_of(lines: list[str]) -> str:
    """The narrow table's legend, its wrapped lines joined back: from ". passed" to the counts."""
    start = next(i for i, line in enumerate(lines) if line.startswith(". passed"))
    end = next(i for i, line in enumerate(lines) if i > start and not line.startswith("  "))
    return " ".join(line.strip() for line in lines[start:end])


@pytest.mark.parametrize("width", [80, 120])
def test_the_main_jobs_table_fits_80_and_120_columns(width: int) -> None:
    lines = summary_table(main_job(), width=width)
    assert max(map(len, lines)) <= width, "\n".join(lines)
    sep = "  " if width == 120 else " "  # two spaces between columns where they fit
    assert lines[0] == "architecture".ljust(29) + sep + sep.join(
        ["import", "inspect", "load", "budget", "startup", "lora", "quant"])
    assert lines[1] == "-" * len(lines[0])
    rows = {line.split()[0]: line.split()[1:] for line in lines[2:7]}
    assert rows["MixtralForCausalLM"] == [".", ".", ".F", "..", ".", "..", "...."]
    assert rows["LlavaForConditionalGeneration"] == [".", ".", "..", "..", ".", "ss", "ssss"]
    assert legend_of(lines) == (". passed, F failed, s skipped, - not run; a mark per item: load, budget, lora "
                                "tp=1,2; quant fp8 tp=1,2, int8 tp=1,2")
    assert lines[-2:] == ["5 architectures: 58 passed, 1 failed, 6 skipped",
                          "skipped 6: <architecture>: no LoRA (LlavaForConditionalGeneration)"]


def test_every_item_keeps_its_outcome_in_the_narrow_table() -> None:
    """A mark per item, in the items' order inside their check's column: nothing of the wide table is lost."""
    results = main_job(("Qwen2ForCausalLM", "quant[int8,tp=1]", "failed"), ("Qwen2ForCausalLM", "budget[tp=2]",
                                                                            "skipped"))
    del results[3]  # Llama's load[tp=2] did not run
    lines = summary_table(results, width=80)
    checks = lines[0].split()[1:]
    items = {check: [item for item in ITEMS if item.split("[")[0] == check] for check in checks}
    shown = {}
    for line in lines[2:7]:
        arch, *marks = line.split()
        for check, cell in zip(checks, marks, strict=True):
            shown.update({(arch, item): mark for item, mark in zip(items[check], cell, strict=True)})
    expected = {(r["arch"], r["check"]): MARKS[str(r["outcome"])] for r in results}
    assert shown == {(arch, item): expected.get((arch, item), NOT_RUN) for arch in BUNDLED for item in ITEMS}
    assert shown["LlamaForCausalLM", "load[tp=2]"] == NOT_RUN


def test_a_table_that_fits_keeps_a_column_per_item() -> None:
    lines = summary_table(main_job(), width=201)
    assert lines[0].split() == ["architecture", *ITEMS] and len(lines[0]) == 201
    assert lines[4].split() == ["MixtralForCausalLM", "ok", "ok", "ok", "FAIL", *["ok"] * 9]
    assert summary_table(main_job(), width=200)[0].split()[1:] == ["import", "inspect", "load", "budget", "startup",
                                                                   "lora", "quant"]


def test_a_name_too_long_for_its_column_has_a_line_of_its_own() -> None:
    lines = summary_table(main_job((LONG, "import", "failed")), width=80)
    assert max(map(len, lines)) <= 80, "\n".join(lines)
    at = lines.index(LONG)
    assert lines[at + 1].split() == ["F", "-", "--", "--", "-", "--", "----"]
    assert lines[at + 1].index("F") == lines[0].index("import")
    assert lines[at - 1].startswith("Qwen3MoeForCausalLM ")  # in order: Qwen3Moe... < Qwen3Omni...


def test_a_tp_size_alone_is_named_in_the_legend() -> None:
    results: list[dict[str, object]] = [{"arch": "LlamaForCausalLM", "check": check, "outcome": "passed", "detail": {}}
                                        for check in ("import", "load[tp=2]", "lora[tp=2]")]
    lines = summary_table([*results, {"arch": LONG, "check": "import", "outcome": "passed", "detail": {}}], width=50)
    assert max(map(len, lines)) <= 50, "\n".join(lines)
    assert legend_of(lines) == ". passed, F failed, s skipped, - not run; a mark per item: load, lora tp=2"


def test_the_counts_and_the_cache_line_wrap_at_word_boundaries() -> None:
    results = main_job()
    results[0]["detail"] = {"cache": {"memory": 70, "disk": 49, "missing": 5}}
    lines = summary_table(results, "all", {"passed": 3}, width=80)
    prose = lines[lines.index("5 architectures: 58 passed, 1 failed, 6 skipped; other tests: 3 passed"):]
    assert prose[1] == "skipped 6: <architecture>: no LoRA (LlavaForConditionalGeneration)"
    assert max(map(len, prose)) <= 80 and all(line.startswith("  ") for line in prose[3:])
    assert " ".join(line.strip() for line in prose[2:]) == (
        "ModelInfo cache (the registry's saved inspection of each class): 119 lookups answered from it (70 in "
        "memory, 49 on disk), 5 inspected the class (5 not cached yet), 0 found a corrupt entry")


SKIPPED_MODULE = "import pytest\n\npytest.importorskip('module_not_installed_here')\n"
NORMAL_TEST = "def test_project_unit():\n    assert True\n"


def test_the_header_fits_and_other_tests_are_those_that_ran(pytester: pytest.Pytester,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """The main job's selection (-m enginecheck) in a project one of whose modules skips at import: its tests were
    never going to run beside the checks, so the summary does not count them (pytest's own line does)."""
    monkeypatch.setenv("COLUMNS", "80")
    monkeypatch.setenv("ENGINE_REF_PLUGINS", "")
    pytester.makepyfile(test_needs_ray=SKIPPED_MODULE, test_project=NORMAL_TEST)
    args = ("-p", "no:cacheprovider", "--enginecheck", "--enginecheck-checks=import,budget",
            "--enginecheck-timeout=60", "-k", "LlamaForCausalLM or project")
    main = pytester.runpytest_subprocess(*args, "-m", "enginecheck", timeout=300)
    main.assert_outcomes(passed=3, skipped=1, deselected=len(BUNDLED) * 3 - 3 + 1)
    header = [line for line in main.outlines if line.startswith("enginecheck: ")]
    assert header == ["enginecheck: target=engine_ref (5 architectures, 0 plugins), tp=1,2",
                      "enginecheck: checks=import,budget, budget=512MiB per rank, timeout=60s"]
    main.stdout.fnmatch_lines(["1 architecture: 3 passed, 0 failed, 0 skipped"])
    assert "other tests" not in main.stdout.str()
    summary = main.outlines[next(i for i, line in enumerate(main.outlines) if " enginecheck summary " in line):]
    assert max(len(line) for line in header + summary) <= 80, main.stdout.str()

    beside = pytester.runpytest_subprocess(*args, "-v", timeout=300)  # the project's tests run beside the checks
    beside.assert_outcomes(passed=4, skipped=1, deselected=len(BUNDLED) * 3 - 3)
    beside.stdout.fnmatch_lines(["1 architecture: 3 passed, 0 failed, 0 skipped; other tests: 1 passed, 1 skipped"])
    assert [line for line in beside.outlines if line.startswith("enginecheck: ")] == [  # -v: every setting
        "enginecheck: target=engine_ref (5 architectures, 0 plugins), tp=1,2",
        "enginecheck: checks=import,budget, quant=fp8,int8",
        "enginecheck: budget=512MiB per rank x 0.9 utilization at max_model_len=128",
        "enginecheck: timeout=60s, device_memory=not predicted, strict=off"]
