"""General plugin 'a': records that it ran."""

from engine_ref_test_plugins import CALLS


def register() -> None:
    CALLS.append("a")
