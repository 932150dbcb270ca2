"""General plugins: code that packages run in every engine process before the engine starts.

A package declares an entry point in the group ``engine_ref.general_plugins``; its callable runs
once per process (typically ``ModelRegistry.register_model(...)`` for out-of-tree models).
ENGINE_REF_PLUGINS restricts which entry points load (by name). A plugin that fails is logged and
skipped, so one broken package cannot stop every engine in the environment.
"""

from __future__ import annotations

import logging
from importlib.metadata import entry_points

from engine_ref import envs

logger = logging.getLogger(__name__)

PLUGINS_GROUP = "engine_ref.general_plugins"

_plugins_loaded = False


def load_general_plugins() -> list[str]:
    """Load and run the allowed general plugins, once per process; return the names that ran."""
    global _plugins_loaded
    if _plugins_loaded:
        return []
    _plugins_loaded = True
    allowed = envs.allowed_plugins()
    loaded: list[str] = []
    for ep in entry_points(group=PLUGINS_GROUP):
        if allowed is not None and ep.name not in allowed:
            logger.debug("plugin %s skipped: not in ENGINE_REF_PLUGINS", ep.name)
            continue
        try:
            ep.load()()
        except Exception:
            logger.exception("engine_ref plugin %r (%s) failed and was skipped", ep.name, ep.value)
            continue
        loaded.append(ep.name)
        logger.info("engine_ref plugin %r loaded", ep.name)
    return loaded
