"""``podium platforms``: every discovered platform, whether it can run here, and why not; with
``--verbose`` its capabilities and options (each option's value as a run would resolve it now)."""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from podium_plugin_api import Platform


def register(subparsers) -> None:
    parser = subparsers.add_parser("platforms", help="list discovered platforms and which one is selected")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.add_argument("--verbose", "-v", action="store_true",
                        help="also print each platform's capabilities and options")
    parser.add_argument("--device", default=None, help="the platform a run would request (default: $PODIUM_DEVICE)")
    parser.set_defaults(func=run)


def platform_rows(device: str | None = None) -> tuple[list[dict], str | None]:
    """One row per platform, and the selection error (None when a platform was selected)."""
    from podium_plugin_api import PlatformSelectionError, load_plugins  # imports torch: not for `podium serve`'s parser

    plugins = load_plugins()
    error = None
    try:
        chosen = plugins.select(device).name
    except PlatformSelectionError as exc:
        chosen, error = None, str(exc)
    rows = []
    for e in plugins.platforms:
        row = {
            "name": e.name,
            "distribution": e.distribution,
            "version": e.version,
            "available": e.availability.ok,
            "reason": e.availability.reason,
            "priority": e.platform.priority,
            "selected": e.name == chosen,
            "api_version": e.platform.api_version,
        }
        try:
            row["capabilities"] = e.platform.capabilities().as_dict()
        except Exception as exc:  # a broken capabilities() is reported, not fatal to the listing
            row["capabilities"] = {"error": f"{type(exc).__name__}: {exc}"}
        row["options"] = option_rows(e.platform)
        rows.append(row)
    return rows, error


def option_rows(platform: Platform) -> list[dict]:
    """Each declared option: name, type, default, the value a run would get now (its alias
    included), allowed values, alias, help."""
    from podium_plugin_api import resolve_options

    try:
        declared = platform.options()
    except Exception as exc:  # reported, not fatal to the listing
        return [{"error": f"options() raised {type(exc).__name__}: {exc}"}]
    try:
        values = dict(resolve_options(platform.name, declared, parsed=False))
    except ValueError as exc:  # a bad alias in the environment: say so where the value would be
        values = {o.name: f"invalid: {exc}" for o in declared}
    return [{"name": o.name, "type": o.type.__name__, "default": o.default, "value": values.get(o.name),
             "choices": list(o.choices), "env": o.env, "help": o.help} for o in declared]


def _option_lines(options: list[dict]) -> list[str]:
    lines = []
    for o in options:
        if "error" in o:
            lines.append(f"    option error: {o['error']}")
            continue
        allowed = f" ({'|'.join(o['choices'])})" if o["choices"] else ""
        alias = f"; alias ${o['env']}" if o["env"] else ""
        shown = "''" if o["value"] == "" else o["value"]
        lines.append(f"    option {o['name']}={shown}  [{o['type']}{allowed}, default {o['default']!r}{alias}]"
                     f": {o['help']}")
    return lines


def format_table(rows: list[dict], verbose: bool = False) -> str:
    headers = ["name", "distribution", "available", "priority", "selected", "reason"]
    cells = [
        [r["name"], f"{r['distribution']} {r['version']}", "yes" if r["available"] else "no",
         str(r["priority"]), "*" if r["selected"] else "", r["reason"]]
        for r in rows
    ]
    widths = [max(len(h), *(len(c[i]) for c in cells)) if cells else len(h) for i, h in enumerate(headers)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(headers, widths)).rstrip()]
    lines.append("  ".join("-" * w for w in widths))
    for row, c in zip(rows, cells):
        lines.append("  ".join(v.ljust(w) for v, w in zip(c, widths)).rstrip())
        if verbose:
            for key, value in row["capabilities"].items():
                lines.append(f"    {key}: {value}")
            lines += _option_lines(row["options"])
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    rows, error = platform_rows(args.device)
    if args.json:
        from podium.cli import print_json

        print_json(rows)
    else:
        print(format_table(rows, args.verbose))
    if error:
        print(f"podium platforms: {error}", file=sys.stderr)
        return 1
    return 0
