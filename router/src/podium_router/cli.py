"""``podium router`` and ``podium fleet up FILE`` (``podium.commands`` entry points), also ``podium-router``.

    podium router --replica http://gpu-box:8000 --replica http://cpu-box:8000 --port 8080
    podium router --replica-file replicas.txt        # reread when it changes
    podium fleet up fleet.toml                       # replicas as Ray actors, the router in front
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

from .policy import POLICIES
from .settings import LOG_LEVELS, ReplicaSpec, RouterSettings


def register_router(subparsers) -> None:
    parser = subparsers.add_parser("router", help="one OpenAI endpoint over many replicas",
                                   description="Route OpenAI requests over replicas (Podium or any OpenAI server).")
    parser.add_argument("--replica", action="append", default=[], metavar="URL",
                        help="a replica's base URL (repeat for more)")
    parser.add_argument("--replica-file", type=Path, default=None,
                        help="a file of replica URLs, one a line (or .toml/.json); reread when it changes")
    add_router_options(parser)
    parser.set_defaults(func=run_router)


def register_fleet(subparsers) -> None:
    parser = subparsers.add_parser("fleet", help="replicas placed by Ray, behind the router")
    actions = parser.add_subparsers(dest="fleet_command", metavar="ACTION", required=True)
    up = actions.add_parser("up", help="start the fleet FILE names and route over it until stopped",
                            description="Start each replica of FILE as a Ray actor (restarted when it dies) "
                                        "and serve the router in front of them.")
    up.add_argument("file", type=Path, help="the fleet file (TOML; see docs/fleet.md)")
    up.add_argument("--address", default=None,
                    help="a Ray cluster's address (default: the file's, else a local Ray instance)")
    add_router_options(up)
    up.set_defaults(func=run_fleet)


def add_router_options(parser: argparse.ArgumentParser) -> None:
    defaults = RouterSettings()
    parser.add_argument("--host", default=defaults.host)
    parser.add_argument("--port", type=int, default=defaults.port)
    parser.add_argument("--api-key", default=os.environ.get("PODIUM_API_KEY"),
                        help="require 'Authorization: Bearer KEY' from clients (default: $PODIUM_API_KEY)")
    parser.add_argument("--replica-api-key", default=None, help="the key the replicas require, if any")
    parser.add_argument("--policy", default=defaults.policy, choices=POLICIES,
                        help="ttft: estimated time to first token (prefix, load, speed); round-robin: for comparison")
    parser.add_argument("--default-prefill-rate", type=float, default=defaults.default_prefill_rate,
                        help="tokens/s assumed for a replica until its rate is measured")
    parser.add_argument("--decode-cap", type=int, default=defaults.decode_cap,
                        help="requests in flight on a replica that does not report its max_num_seqs")
    parser.add_argument("--poll-interval", type=float, default=defaults.poll_interval_s,
                        help="seconds between replica reports / health checks")
    parser.add_argument("--max-attempts", type=int, default=defaults.max_attempts,
                        help="replicas tried for a request that has not streamed a byte")
    parser.add_argument("--request-timeout", type=float, default=defaults.request_timeout_s,
                        help="seconds without a byte from a replica before the attempt fails")
    parser.add_argument("--log-level", default=defaults.log_level, choices=LOG_LEVELS)
    parser.add_argument("--debug", action="store_true", help="show tracebacks")


def settings_from_args(args: argparse.Namespace, replicas: list[str] = ()) -> RouterSettings:
    return RouterSettings(
        replicas=tuple(ReplicaSpec(url) for url in replicas), replica_file=getattr(args, "replica_file", None),
        host=args.host, port=args.port, api_key=args.api_key or None, replica_api_key=args.replica_api_key,
        policy=args.policy, default_prefill_rate=args.default_prefill_rate, decode_cap=args.decode_cap,
        poll_interval_s=args.poll_interval, max_attempts=args.max_attempts,
        request_timeout_s=args.request_timeout, log_level=args.log_level)


def run_router(args: argparse.Namespace) -> int:
    if not args.replica and args.replica_file is None:
        raise ValueError("give at least one --replica URL or a --replica-file")
    if args.replica_file is not None and not args.replica_file.exists():
        raise ValueError(f"--replica-file {args.replica_file} does not exist")
    settings = settings_from_args(args, args.replica)
    serve(settings)
    return 0


def run_fleet(args: argparse.Namespace) -> int:
    from .fleet import FleetSpec, run_fleet_up

    spec = FleetSpec.read(args.file)
    return run_fleet_up(spec, settings_from_args(args), address=args.address)


def serve(settings: RouterSettings, on_start=None) -> None:
    import uvicorn

    from .app import create_app

    logging.basicConfig(level=settings.log_level.upper() if settings.log_level != "trace" else "DEBUG",
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    auth = "on" if settings.api_key else "off"
    print(f"podium router: {len(settings.replicas)} replica(s)"
          f"{f' + file {settings.replica_file}' if settings.replica_file else ''}, policy {settings.policy}; "
          f"listening on http://{settings.host}:{settings.port} (API key {auth})", flush=True)
    uvicorn.run(create_app(settings, on_start), host=settings.host, port=settings.port,
                log_level=settings.log_level, access_log=settings.log_level in ("debug", "trace"),
                timeout_keep_alive=65)  # longer than clients keep idle connections (see podium serve)


def main(argv: list[str] | None = None) -> int:
    """``podium-router ...``: the router without the core's ``podium`` command."""
    parser = argparse.ArgumentParser(prog="podium-router")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    register_router(sub)
    register_fleet(sub)
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        return 130
    except Exception as exc:
        if args.debug:
            raise
        print(f"podium-router {args.command}: error: {exc}", file=sys.stderr)
        return 1
