"""What an out-of-tree model class tells the checker about its tiny config: ``enginecheck_config``.

A class attribute vLLM never reads, beside ``enginecheck_reference`` (pytest_enginecheck/reference.py), for the same
reason: it travels with the model's own distribution (a ``vllm.general_plugins`` entry point registers the class;
there is no conftest.py of the author's where the engine's CI runs), it is found where the class is resolved, and
engine_ref's models already declare their whole tiny config the same way (``example_config``). Its value is a dict
of config.json fields, or a callable without arguments returning one: the fields a subclass reads that its
transformers base config has not (``use_embedding_scale: True``), or a size the shrink rules get wrong for it. They
are set on the tiny config after the shrink rules, so the author gives only what the checker cannot guess.
"""

from __future__ import annotations

import json
from typing import Any

CONFIG_ATTRIBUTE = "enginecheck_config"


class ConfigDeclarationError(Exception):
    """The tiny config a model class declares is not usable; the message names the value and the fix."""


def declared_config(architecture: str, model_cls: type | None) -> dict[str, Any]:
    """The config.json fields ``model_cls`` declares in ``enginecheck_config`` ({} where it declares none)."""
    value = getattr(model_cls, CONFIG_ATTRIBUTE, None) if model_cls is not None else None
    if value is None:
        return {}
    fix = (f"set {CONFIG_ATTRIBUTE} on {architecture}'s class to a dict of config.json fields (e.g. "
           f"{{\"use_embedding_scale\": true}}), or to a function without arguments that returns one")
    if callable(value) and not isinstance(value, dict):
        try:
            value = value()
        except Exception as e:  # noqa: BLE001 - the author's function: told with the declaration that names it
            raise ConfigDeclarationError(f"{architecture}.{CONFIG_ATTRIBUTE}() raised {type(e).__name__}: {e}; "
                                         f"{fix}") from None
    if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
        raise ConfigDeclarationError(f"{architecture}.{CONFIG_ATTRIBUTE} is {value!r}, not a dict with string keys: "
                                     f"{fix}")
    try:
        return dict(json.loads(json.dumps(value)))
    except (TypeError, ValueError) as e:
        raise ConfigDeclarationError(f"{architecture}.{CONFIG_ATTRIBUTE} cannot be written to config.json ({e}): "
                                     f"{fix}") from None
