"""Every `vlora` subcommand prints its help, and every option says what it does."""

from __future__ import annotations

import argparse

import pytest

from vlora.cli import build_parser, main


def _subcommands(parser: argparse.ArgumentParser, prefix=()):
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield prefix + (name,), sub
                yield from _subcommands(sub, prefix + (name,))


SUBCOMMANDS = [path for path, _ in _subcommands(build_parser())]


def test_subcommands_found():
    assert {("serve",), ("generate",), ("bench",), ("tune",), ("adapters", "fuse")} <= set(SUBCOMMANDS)


@pytest.mark.parametrize("path", [()] + SUBCOMMANDS, ids=lambda p: " ".join(p) or "vlora")
def test_help_prints(path, capsys):
    with pytest.raises(SystemExit) as exit_:
        main([*path, "--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: vlora")


@pytest.mark.parametrize("path", SUBCOMMANDS, ids=" ".join)
def test_every_option_has_help(path):
    parser = dict(_subcommands(build_parser()))[path]
    missing = [a.option_strings[0] for a in parser._actions
               if a.option_strings and a.help in (None, "") and a.dest != "help"]
    assert not missing, f"options without help in vlora {' '.join(path)}: {missing}"
