"""The ``podium`` command list: the core's commands, the ones other distributions register, and a
clear message for one whose distribution is not installed."""

from __future__ import annotations

import argparse

from podium import cli


def _commands(parser: argparse.ArgumentParser) -> dict:
    return next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices


def test_commands_come_from_the_core_and_the_entry_points():
    commands = _commands(cli.build_parser())
    assert {"platforms", "serve", "bench", "run-batch"} <= set(commands)
    assert "--input-file" in commands["run-batch"].format_help()  # podium-server's parser, not a stub
    assert "generate" not in commands  # never existed; no longer named
    assert "--tensor-parallel-size" in commands["serve"].format_help()  # podium-server's parser, not a stub


def test_a_missing_distribution_is_named_with_its_install_command(monkeypatch, capsys):
    monkeypatch.setattr(cli, "entry_points", lambda group: [])
    commands = _commands(cli.build_parser())
    assert set(commands) == {"platforms", "serve", "bench", "run-batch"}
    assert cli.main(["bench", "throughput", "--num-prompts", "2"]) == 2
    assert "needs podium-bench, which is not installed (pip install ./bench)" in capsys.readouterr().err
    assert cli.main(["serve"]) == 2
    assert "needs podium-server" in capsys.readouterr().err
