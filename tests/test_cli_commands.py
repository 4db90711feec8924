"""The ``podium`` command list: the core's commands, the ones other distributions register, and a
clear message for one whose distribution is not installed."""

from __future__ import annotations

import argparse
import pickle
import subprocess
import sys

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


def test_the_serving_process_reads_its_command_line_and_the_engine_stats_without_torch():
    """`podium serve`'s own process (the engine runs in a child of its own) parses its command line,
    builds its app and unpickles the stats the engine sends every step without importing torch,
    which would add ~180 MiB to the serving RSS."""
    from podium.engine import EngineStats  # the class the engine builds its stats from

    stats = pickle.dumps(EngineStats(1, 0, 10, 12, 0.2, 3, 1, 0))
    code = ("import pickle, sys\n"
            "from podium.cli import build_parser\n"
            "build_parser().parse_args(['serve', '--port', '8000'])\n"
            "import podium_server.app, podium_server.process_engine\n"
            "stats = pickle.loads(sys.stdin.buffer.read())\n"
            "assert stats.num_free_blocks == 10, stats\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'torch'))\n")
    done = subprocess.run([sys.executable, "-c", code], input=stats, capture_output=True, check=True, timeout=120)
    assert done.stdout.decode().strip() == "[]", done.stderr.decode()
