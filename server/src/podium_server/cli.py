"""``podium serve``: registered into the core's CLI through the ``podium.commands`` entry point."""

from __future__ import annotations

import sys


def register(subparsers) -> None:
    parser = subparsers.add_parser("serve", help="serve an OpenAI-compatible API")
    parser.add_argument("model", nargs="?", default="smollm2-135m-instruct")
    parser.set_defaults(func=run)


def run(args) -> int:
    print("podium serve: serving is not built yet (the engine is being built); nothing was started.", file=sys.stderr)
    return 2
