"""The environment SGLang's model modules are imported under in the check children.

Importing ``sglang.srt.models.registry`` (which many model modules do) runs SGLang's lenient scan of
every model module, unless ``SGLANG_EXTERNAL_MODEL_PACKAGE`` names a package: then only that one is
scanned and the in-tree scan is deferred. So the children get an empty package of the session's
(``EMPTY_PACKAGE`` in the workdir, on ``PYTHONPATH``): a fork then imports only its own model module.
The user's out-of-tree package, if ``SGLANG_EXTERNAL_MODEL_PACKAGE`` named one, is kept in
``USER_PACKAGE_VARIABLE``: its modules are checked one by one like in-tree ones, and the plugins check
loads it as SGLang does, in a fresh interpreter with the variable set back to it.
"""

from __future__ import annotations

import os
import sys
from collections.abc import MutableMapping
from pathlib import Path

EXTERNAL_VARIABLE = "SGLANG_EXTERNAL_MODEL_PACKAGE"  # SGLang's own: the out-of-tree model package
USER_PACKAGE_VARIABLE = "ENGINECHECK_SGLANG_EXTERNAL_PACKAGE"  # the user's value, while the children get ours
EMPTY_PACKAGE = "_enginecheck_sglang_no_models"  # an empty package: SGLang's registry then scans nothing
# Caches SGLang (and the libraries it imports) write to: into the session's directory unless the user chose them.
CACHE_VARIABLES = ("SGLANG_CACHE_DIR", "TRITON_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR")


def external_package(environ: MutableMapping[str, str] | None = None) -> str | None:
    """The user's out-of-tree model package (``SGLANG_EXTERNAL_MODEL_PACKAGE``), None when there is none."""
    env = os.environ if environ is None else environ
    name = env.get(USER_PACKAGE_VARIABLE) or env.get(EXTERNAL_VARIABLE) or ""
    return None if name.strip() in ("", EMPTY_PACKAGE) else name.strip()


def write_empty_package(workdir: str) -> str:
    """Create ``EMPTY_PACKAGE`` under ``workdir``; the directory to put on the path."""
    root = Path(workdir) / "sglang-no-models"
    (root / EMPTY_PACKAGE).mkdir(parents=True, exist_ok=True)
    (root / EMPTY_PACKAGE / "__init__.py").write_text('"""No models: SGLang\'s registry scans nothing."""\n')
    return str(root)


def prepare_environment(workdir: str, environ: MutableMapping[str, str] | None = None) -> None:
    """Point SGLang at the session's empty package (keeping the user's in ``USER_PACKAGE_VARIABLE``) and its caches
    into ``workdir`` (those the user did not set). ``environ``: os.environ unless given (tests)."""
    env = os.environ if environ is None else environ
    user = external_package(env)
    if user is not None:
        env[USER_PACKAGE_VARIABLE] = user
    root = write_empty_package(workdir)
    env[EXTERNAL_VARIABLE] = EMPTY_PACKAGE
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH", "")) if p)
    if environ is None and root not in sys.path:
        sys.path.append(root)  # this process's forks (the describe child) find it too
    for name in CACHE_VARIABLES:
        if name not in env:
            path = Path(workdir) / "caches" / name.lower()
            path.mkdir(parents=True, exist_ok=True)
            env[name] = str(path)


def engine_environment(environ: MutableMapping[str, str] | None = None) -> dict[str, str]:
    """The environment of a fresh interpreter in SGLang's own state: the user's package set back as
    ``SGLANG_EXTERNAL_MODEL_PACKAGE`` (or unset), the session's empty package off the path."""
    env = dict(os.environ if environ is None else environ)
    user = env.pop(USER_PACKAGE_VARIABLE, None)
    if user:
        env[EXTERNAL_VARIABLE] = user
    elif env.get(EXTERNAL_VARIABLE) == EMPTY_PACKAGE:
        del env[EXTERNAL_VARIABLE]
    return env
