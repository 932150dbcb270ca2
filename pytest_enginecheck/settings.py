"""A run's settings: the options resolved once (``options.resolve_settings``) and their defaults, in one place.

Every check gets them as ``CheckContext.options``, so this module stays light: check children unpickle it, and they
import neither pytest nor an engine for it.
"""

from __future__ import annotations

from dataclasses import dataclass

from pytest_enginecheck.targets import DEFAULT_TARGET

TP_SIZES = (1, 2)
TIMEOUT_S = 120.0
BUDGET_MEMORY = "512MiB"
BUDGET_UTILIZATION = 0.9
BUDGET_MAX_MODEL_LEN = 128
QUANT_METHODS = ("fp8", "int8")


@dataclass(frozen=True)
class Settings:
    """The resolved options of one run; ``Settings()`` is a run with every option at its default."""

    enabled: bool = False
    target: str = DEFAULT_TARGET
    checks: tuple[str, ...] | None = None  # None: every check that applies to the target
    tp_sizes: tuple[int, ...] = TP_SIZES
    timeout: float = TIMEOUT_S
    json_path: str | None = None
    strict: bool = False
    device_memory: str | None = None
    summary: str | None = None  # None: all, or failures at 400 architectures or more
    budget_memory: str = BUDGET_MEMORY  # the budget check's tiny engine: device size, utilisation, max_model_len
    budget_utilization: float = BUDGET_UTILIZATION
    budget_max_model_len: int = BUDGET_MAX_MODEL_LEN
    quant_methods: tuple[str, ...] = QUANT_METHODS
    trace_dir: str | None = None  # ENGINE_REF_TRACE_DIR of the check children's engines
    html_path: str | None = None  # --enginecheck-html: the self-contained HTML report (html_report.py)
    import_profile: int = 0  # modules per architecture the import profile prints (0: no profile printed)
    # --enginecheck-fail-on-skip: the architectures whose skipped items fail ("plugins", "all" or fnmatch patterns)
    fail_on_skip: tuple[str, ...] = ()
    # The targets' own options (``Target.options``), as (name, value): a check reads one with ``TargetOption.value``.
    target_options: tuple[tuple[str, str], ...] = ()
