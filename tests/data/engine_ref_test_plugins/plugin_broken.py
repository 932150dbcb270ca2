"""General plugin 'broken': fails, as a broken package in the environment would."""

from engine_ref_test_plugins import CALLS


def register() -> None:
    CALLS.append("broken")
    raise RuntimeError("plugin broken on purpose: 9913")
