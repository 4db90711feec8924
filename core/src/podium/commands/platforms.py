"""``podium platforms``: every discovered platform, whether it can run here, and why not."""

from __future__ import annotations

import argparse
import sys

from podium.discovery import PlatformSelectionError, discover_platforms, select_platform


def register(subparsers) -> None:
    parser = subparsers.add_parser("platforms", help="list discovered platforms and which one is selected")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.add_argument("--verbose", "-v", action="store_true", help="also print each platform's capabilities")
    parser.add_argument("--device", default=None, help="the platform a run would request (default: $PODIUM_DEVICE)")
    parser.set_defaults(func=run)


def platform_rows(device: str | None = None) -> tuple[list[dict], str | None]:
    """One row per platform, and the selection error (None when a platform was selected)."""
    entries = discover_platforms()
    error = None
    try:
        chosen = select_platform(device, entries).name
    except PlatformSelectionError as exc:
        chosen, error = None, str(exc)
    rows = []
    for e in entries:
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
        rows.append(row)
    return rows, error


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
