"""The ``podium`` command line.

Subcommands come from the core (``platforms``) and from other distributions through the
``podium.commands`` entry-point group (``podium-server`` adds ``serve``, ``podium-bench`` adds
``bench``), so the core imports neither. An entry point names a function ``register(subparsers)``
that adds its parser and sets ``func`` to its handler. The engine's flags, which ``serve`` and
``bench`` share, are defined once in ``podium.engine_flags``.
"""

from __future__ import annotations

import argparse
import json
import sys
from importlib import import_module
from importlib.metadata import entry_points

COMMAND_GROUP = "podium.commands"
CORE_COMMANDS = ("podium.commands.platforms",)
# commands other distributions add: name -> (help, distribution, how to install it)
OPTIONAL_COMMANDS = {
    "serve": ("serve an OpenAI-compatible API", "podium-server", "pip install ./server"),
    "run-batch": ("run an OpenAI batch file offline, resumably", "podium-server", "pip install ./server"),
    "bench": ("benchmark throughput, latency or a running server", "podium-bench", "pip install ./bench"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="podium", description="Podium LLM inference engine")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for module_name in CORE_COMMANDS:
        import_module(module_name).register(subparsers)
    for ep in entry_points(group=COMMAND_GROUP):
        if ep.name not in subparsers.choices:
            ep.load()(subparsers)
    for name, (help, dist, fix) in OPTIONAL_COMMANDS.items():
        if name not in subparsers.choices:
            missing = subparsers.add_parser(name, help=f"{help} (needs {dist})")
            missing.set_defaults(func=lambda args, dist=dist, fix=fix: _missing(dist, fix))
            missing.add_argument("rest", nargs=argparse.REMAINDER)
    return parser


def _missing(dist: str, fix: str) -> int:
    print(f"podium: this command needs {dist}, which is not installed ({fix})", file=sys.stderr)
    return 2


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        return 130
    except Exception as exc:  # the CLI's edge: one clear line instead of a traceback
        if getattr(args, "debug", False):
            raise
        print(f"podium {args.command}: error: {exc}", file=sys.stderr)
        return 1


def print_json(obj) -> None:
    print(json.dumps(obj, indent=2, default=str))


if __name__ == "__main__":
    sys.exit(main())
