"""``engine-ref --help`` for the commands model authors run: every flag says what it does."""

from __future__ import annotations

import argparse

import pytest

from engine_ref.entrypoints.cli import build_parser


def _subparser(command: str) -> argparse.ArgumentParser:
    (sub,) = [a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)]
    return sub.choices[command]


@pytest.mark.parametrize("command", ["startup", "make-checkpoint"])
def test_every_flag_has_help(command: str) -> None:
    actions = [a for a in _subparser(command)._actions if not isinstance(a, argparse._HelpAction)]
    assert actions
    assert [a.dest for a in actions if not a.help] == []


def test_prepare_model_info_says_where_the_cache_lives() -> None:
    help_text = " ".join(build_parser().format_help().split())
    assert "(ENGINE_REF_CACHE_ROOT/modelinfos, by default ~/.cache/engine_ref/modelinfos)" in help_text
