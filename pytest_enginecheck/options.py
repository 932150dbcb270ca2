"""The plugin's options: each CLI flag has an ini twin; the CLI wins, then the ini file."""

from __future__ import annotations

import os
from dataclasses import dataclass

import pytest

from pytest_enginecheck.checks import CHECKS

HELP = {
    "enginecheck": "check every registered architecture of the target engine (import, inspect, load, budget, startup)",
    "target": "engine to check: 'engine_ref' (bundled zoo), 'vllm', or 'module:attribute' naming a mapping "
              "of architecture -> 'module:Class' or an engine_ref ModelRegistry",
    "checks": f"comma-separated checks to run (default: all that apply to the target): {','.join(CHECKS)}",
    "tp": "comma-separated tensor parallel sizes for the load and budget checks; startup uses the largest that "
          "splits the model (default: 1,2)",
    "timeout": "seconds each check may take before its process tree is killed (default: 120)",
    "json": "write the results as JSON to this path",
    "strict": "also fail an import that calls torch.cuda.is_available()/device_count() (cuInit on GPU hosts)",
    "device_memory": "predict the fit of each architecture's full-size config on a device of this size, e.g. 80GiB",
    "trace": "write a Chrome trace-event JSON of every engine start the checks make into this directory (one "
             "track per rank; open it in https://ui.perfetto.dev or chrome://tracing)",
}


def _add(group: pytest.OptionGroup, parser: pytest.Parser, name: str, ini_type: str | None = None,
         **kwargs: object) -> None:
    flag = "--enginecheck" if name == "enginecheck" else f"--enginecheck-{name.replace('_', '-')}"
    dest = "enginecheck" if name == "enginecheck" else f"enginecheck_{name}"
    group.addoption(flag, dest=dest, help=HELP[name], **kwargs)
    parser.addini(dest, help=HELP[name], type=ini_type or "string", default=None)


def add_options(parser: pytest.Parser) -> None:
    group = parser.getgroup("enginecheck", "engine startup checks (pytest-enginecheck)")
    _add(group, parser, "enginecheck", ini_type="bool", action="store_true", default=None)
    _add(group, parser, "target", metavar="SPEC")
    _add(group, parser, "checks", metavar="LIST")
    _add(group, parser, "tp", metavar="SIZES")
    _add(group, parser, "timeout", metavar="SECONDS")
    _add(group, parser, "json", metavar="PATH")
    _add(group, parser, "strict", ini_type="bool", action="store_true", default=None)
    _add(group, parser, "device_memory", metavar="SIZE")
    _add(group, parser, "trace", metavar="DIR")


@dataclass(frozen=True)
class Settings:
    """The resolved options of one run."""

    enabled: bool
    target: str
    checks: tuple[str, ...] | None  # None: every check that applies to the target
    tp_sizes: tuple[int, ...]
    timeout: float
    json_path: str | None
    strict: bool
    device_memory: str | None
    trace_dir: str | None = None  # ENGINE_REF_TRACE_DIR of the check children's engines


def _get(config: pytest.Config, dest: str) -> object:
    value = config.getoption(dest)
    return value if value is not None else config.getini(dest)


def _csv(value: object) -> list[str]:
    return [part.strip() for part in str(value).split(",") if part.strip()]


def resolve_settings(config: pytest.Config) -> Settings:
    """Read every option (CLI, then ini) and validate it; bad values raise pytest.UsageError."""
    checks = None
    if _get(config, "enginecheck_checks"):
        checks = tuple(_csv(_get(config, "enginecheck_checks")))
        unknown = [c for c in checks if c not in CHECKS]
        if unknown:
            raise pytest.UsageError(
                f"--enginecheck-checks: unknown check(s) {', '.join(unknown)}; choose from {','.join(CHECKS)}")
    try:
        tp_sizes = tuple(int(s) for s in _csv(_get(config, "enginecheck_tp") or "1,2"))
        if not tp_sizes or min(tp_sizes) < 1:
            raise ValueError
    except ValueError:
        raise pytest.UsageError(
            f"--enginecheck-tp={_get(config, 'enginecheck_tp')!r}: give positive integers, e.g. 1,2") from None
    try:
        timeout = float(_get(config, "enginecheck_timeout") or 120)
        if timeout <= 0:
            raise ValueError
    except ValueError:
        raise pytest.UsageError(
            f"--enginecheck-timeout={_get(config, 'enginecheck_timeout')!r}: give a positive number of seconds"
        ) from None
    device_memory = _get(config, "enginecheck_device_memory") or None
    if device_memory:
        from engine_ref.errors import ConfigError
        from engine_ref.utils import parse_size

        try:
            parse_size(str(device_memory), "--enginecheck-device-memory")
        except ConfigError as e:
            raise pytest.UsageError(str(e)) from None
    return Settings(
        enabled=bool(_get(config, "enginecheck")),
        target=str(_get(config, "enginecheck_target") or "engine_ref"),
        checks=checks,
        tp_sizes=tp_sizes,
        timeout=timeout,
        json_path=_get(config, "enginecheck_json") or None,
        strict=bool(_get(config, "enginecheck_strict")),
        device_memory=str(device_memory) if device_memory else None,
        trace_dir=(os.path.abspath(str(_get(config, "enginecheck_trace")))
                   if _get(config, "enginecheck_trace") else None),
    )
