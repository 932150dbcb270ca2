"""Sharding across machines with pytest-split (``--splits N --group i``): the roots of a check are the items
selected in every shard, not only in this one.

pytest-split keeps this shard's group in a ``trylast`` ``pytest_collection_modifyitems`` of the plugin object it
registers at ``pytest_configure``. This module is a ``pytest11`` entry point, registered before that object, so its
own ``trylast`` hook runs before pytest-split's (pluggy calls ``trylast`` hooks in registration order): it sees the
items -k / -m selected, in every shard. After the session has given each check its roots (from this shard's
items), the roots that run in another shard are added: a failure whose root ran elsewhere reruns the root here
(``runner.run_item``, the failure path only), as a pytest-xdist worker does, so the verdicts do not depend on
the split. Loaded in every pytest run: it imports nothing heavy.
"""

from __future__ import annotations

from typing import Any

import pytest

SELECTED = pytest.StashKey[list[pytest.Item]]()  # the items of every shard, before pytest-split keeps its group


def stable_nodeid(nodeid: str) -> str:
    """The node id without pytest-xdist's ``@group`` suffix (``--dist loadgroup`` appends it in the workers), so a
    root is named the same way whatever ``--dist`` ran it."""
    return nodeid[:nodeid.rfind("@")] if nodeid.rfind("@") > nodeid.rfind("]") else nodeid


def _split_plugin(config: pytest.Config) -> Any:
    return config.pluginmanager.get_plugin("pytestsplitplugin")


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list[pytest.Item]) -> None:
    """Remember the items of every shard (after -k / -m, before pytest-split takes this shard's group)."""
    if _split_plugin(config) is not None:
        session.stash[SELECTED] = list(items)


@pytest.hookimpl(trylast=True)
def pytest_collection_finish(session: pytest.Session) -> None:
    """Give each check of this shard its roots in the other shards too (after the session gave those here), each
    named by its stable node id."""
    from pytest_enginecheck.checks import roots
    from pytest_enginecheck.items import CheckItem

    selected = session.stash.get(SELECTED, None)
    if selected is None:  # one shard: the roots are the session's, named without pytest-xdist's @group suffix
        selected = session.items
    if not any(isinstance(item, CheckItem) for item in selected):
        return
    if selected is not session.items:
        _check_split(session, selected)
    every = {(item.ctx.architecture, item.name): item for item in selected if isinstance(item, CheckItem)}
    for item in session.items:
        if not isinstance(item, CheckItem):
            continue
        found = {name: (stable_nodeid(every[item.ctx.architecture, name].nodeid),
                        every[item.ctx.architecture, name].ctx)
                 for name in roots(item.ctx) if (item.ctx.architecture, name) in every}
        item.depend_on(found, item.known)


def _check_split(session: pytest.Session, selected: list[pytest.Item]) -> None:
    """Refuse to run when what this module saw is not what pytest-split split (another plugin reordered the
    hooks): the roots would then be wrong without a word."""
    from pytest_split import algorithms

    config = session.config
    algorithm = algorithms.Algorithms[config.option.splitting_algorithm].value
    group = algorithm(config.option.splits, selected, _split_plugin(config).cached_durations)[config.option.group - 1]
    if not {id(item) for item in session.items} <= {id(item) for item in group.selected}:
        raise pytest.UsageError(
            "pytest-enginecheck could not see the items pytest-split split (a plugin changed the order of the "
            "collection hooks), so the checks' roots in other shards are unknown. Run without --splits, or report "
            "this with the output of `pytest --trace-config`.")
