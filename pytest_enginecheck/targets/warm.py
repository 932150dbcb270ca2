"""Preloaded by the warm parent: the target ``ENGINECHECK_TARGET`` names, loaded once (its entry point found and
its factory called), so no check child scans the installed distributions for it again."""

from __future__ import annotations

import contextlib
import os

from pytest_enginecheck.targets import TargetError, load_target

if os.environ.get("ENGINECHECK_TARGET"):
    with contextlib.suppress(TargetError):  # each check child reports it
        load_target(os.environ["ENGINECHECK_TARGET"])
