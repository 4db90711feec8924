"""``podium serve [MODEL]``: registered into the core's CLI through the ``podium.commands`` entry point.

The engine's flags are the core's one definition (``podium.engine_flags``: vLLM's names, shared
with ``podium bench``); the server's own flags follow. Builds the settings, loads the engine
before binding the port (so a bad model or device fails at once, with the core's message), logs
each startup stage, prints what was chosen, then runs uvicorn. SIGTERM drains (drain.py): new
requests get 503, running ones get up to ``--shutdown-timeout`` seconds, then are ended with an
error; the process exits 0 as soon as nothing is in flight. A second SIGTERM, or Ctrl-C, stops
at once (uvicorn's own shutdown).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import ssl

from podium.config import DEFAULT_MODEL, parse_size
from podium.engine_args import engine_config
from podium.engine_flags import add_engine_flags, engine_kwargs

from .audit import AuditSettings
from .logs import configure_logging
from .reasoning import REASONING_PARSERS
from .settings import ENGINE_MODES, LOG_LEVELS, METRICS_COMPAT, ServerSettings
from .tls import TLSSettings
from .tool_parsers import TOOL_PARSERS


def register(subparsers) -> None:
    parser = subparsers.add_parser("serve", help="serve an OpenAI-compatible API",
                                   description="Serve MODEL through an OpenAI-compatible HTTP API.")
    parser.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                        help=f"model folder, .gguf file or known name, as --model (default: {DEFAULT_MODEL})")
    add_engine_flags(parser)
    server = parser.add_argument_group("server")
    server.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1)")
    server.add_argument("--port", type=int, default=8000, help="port to listen on (default: 8000)")
    server.add_argument("--api-key", default=os.environ.get("PODIUM_API_KEY"),
                        help="require 'Authorization: Bearer KEY' on the API (default: $PODIUM_API_KEY, else none)")
    server.add_argument("--max-request-bytes", default="16MiB",
                        help="larger request bodies get 413 (default: 16MiB)")
    server.add_argument("--shutdown-timeout", type=float, default=30.0,
                        help="seconds in-flight requests get to finish on SIGTERM before they are ended with an "
                             "error; new requests get 503 meanwhile (default: 30)")
    server.add_argument("--max-json-depth", type=int, default=ServerSettings.max_json_depth,
                        help=f"deeper JSON nesting in a request gets 400 (default: {ServerSettings.max_json_depth})")
    server.add_argument("--max-json-string-chars", type=int, default=ServerSettings.max_json_string_chars,
                        help="a longer string in a request's JSON gets 400 "
                             f"(default: {ServerSettings.max_json_string_chars})")
    server.add_argument("--max-json-array-items", type=int, default=ServerSettings.max_json_array_items,
                        help="a longer array (or object) in a request's JSON gets 400 "
                             f"(default: {ServerSettings.max_json_array_items})")
    server.add_argument("--metrics-compat", default=ServerSettings.metrics_compat, choices=METRICS_COMPAT,
                        help="vllm: /metrics also serves vLLM's metric names for the same series, for vLLM "
                             "dashboards (default: none)")
    server.add_argument("--engine-mode", default=ServerSettings.engine_mode, choices=ENGINE_MODES,
                        help="run the model steps in a child process or on a thread of the server "
                             f"(default: {ServerSettings.engine_mode}; measured in server/benchmarks/saturation.py)")
    server.add_argument("--log-level", default="info", choices=LOG_LEVELS,
                        help="uvicorn's and Podium's log level (default: info)")
    server.add_argument("--debug", action="store_true", help="show tracebacks (default: off)")
    add_service_flags(parser)
    server.add_argument("--tool-call-parser", default=None, choices=sorted(TOOL_PARSERS),
                        help="the model family's tool-call format, parsed for tool_choice 'auto' (default: none)")
    server.add_argument("--enable-auto-tool-choice", action="store_true",
                        help="let the model decide whether to call a tool, tool_choice 'auto' (needs "
                             "--tool-call-parser) (default: off)")
    server.add_argument("--reasoning-parser", default=None, choices=sorted(REASONING_PARSERS),
                        help="split the model's <think> section into reasoning_content (default: none)")
    server.add_argument("--lora-modules", nargs="+", type=lora_module, action="extend", default=[],
                        metavar="NAME=PATH",
                        help="LoRA adapters to load at startup, each NAME=PATH or vLLM's JSON form "
                             "'{\"name\": NAME, \"path\": PATH}'; a request's model names one (needs --enable-lora) "
                             "(default: none)")
    server.add_argument("--allowed-origins", type=_name_list, default=(),
                        help="CORS: origins allowed to call the API from a browser, comma-separated or a JSON "
                             "list; '*' for any (default: none, no CORS headers)")
    server.add_argument("--allowed-methods", type=_name_list, default=("*",),
                        help="CORS: allowed methods (default: *)")
    server.add_argument("--allowed-headers", type=_name_list, default=("*",),
                        help="CORS: allowed request headers (default: *)")
    parser.set_defaults(func=run)


def add_service_flags(parser: argparse.ArgumentParser) -> None:
    """TLS, tenants and the audit log (docs/operations.md)."""
    tls = parser.add_argument_group("TLS")
    tls.add_argument("--ssl-keyfile", default=None, help="the server's private key (PEM); with --ssl-certfile: HTTPS (default: none, plain HTTP)")
    tls.add_argument("--ssl-certfile", default=None, help="the server's certificate chain (PEM) (default: none)")
    tls.add_argument("--ssl-ca-certs", default=None, help="CA certificates that client certificates must chain to (default: none)")
    tls.add_argument("--ssl-cert-reqs", type=int, default=int(ssl.CERT_NONE), choices=(0, 1, 2),
                     help="client certificates: 0 not asked, 1 optional, 2 required (default: 0)")
    service = parser.add_argument_group("tenants and audit")
    service.add_argument("--api-keys-file", default=None,
                         help="TOML or JSON file of API keys (as SHA-256) -> tenants with limits and a scheduling "
                              "weight; reloaded when it changes (default: none)")
    service.add_argument("--audit-log", default=None, metavar="FILE",
                         help="write one JSON line per API request to FILE (default: none)")
    service.add_argument("--audit-log-content", action="store_true",
                         help="put the prompt and output text in the audit log too (default: off)")
    service.add_argument("--audit-log-max-bytes", default="100MiB",
                         help="rotate the audit log past this size (default: 100MiB)")
    service.add_argument("--audit-log-backups", type=int, default=5,
                         help="rotated audit logs kept as FILE.1 .. FILE.N (default: 5)")


def settings_from_args(args: argparse.Namespace) -> ServerSettings:
    kwargs = engine_kwargs(args)
    if args.model_tag is not None:
        if kwargs.get("model", args.model_tag) != args.model_tag:
            raise ValueError(f"two models given: {args.model_tag!r} and --model {kwargs['model']!r}; give one")
        kwargs["model"] = args.model_tag
    return ServerSettings(engine=engine_config(**kwargs), host=args.host, port=args.port,
                          api_key=args.api_key or None, log_level=args.log_level,
                          max_request_bytes=parse_size(args.max_request_bytes),
                          shutdown_timeout=args.shutdown_timeout, engine_mode=args.engine_mode,
                          api_keys_file=args.api_keys_file, audit=audit_settings(args),
                          tls=TLSSettings.from_flags(args.ssl_keyfile, args.ssl_certfile, args.ssl_ca_certs,
                                                     args.ssl_cert_reqs),
                          max_json_depth=args.max_json_depth, max_json_string_chars=args.max_json_string_chars,
                          max_json_array_items=args.max_json_array_items, metrics_compat=args.metrics_compat,
                          tool_call_parser=args.tool_call_parser, enable_auto_tool_choice=args.enable_auto_tool_choice,
                          reasoning_parser=args.reasoning_parser, allowed_origins=args.allowed_origins,
                          allowed_methods=args.allowed_methods, allowed_headers=args.allowed_headers,
                          lora_modules=tuple(args.lora_modules))


def audit_settings(args: argparse.Namespace) -> AuditSettings | None:
    if args.audit_log is None:
        if args.audit_log_content:
            raise ValueError("--audit-log-content needs --audit-log FILE")
        return None
    return AuditSettings(args.audit_log, content=args.audit_log_content,
                         max_bytes=parse_size(args.audit_log_max_bytes), backups=args.audit_log_backups)


# Idle keep-alive connections stay open this long: longer than clients keep theirs (httpx drops an
# idle pooled connection after 5 s, the router and `podium bench serve` after 2 s), so the server
# never closes a connection just as a client reuses it (uvicorn's own 5 s raced httpx's 5 s: a
# ReadError on a few of 1,000 requests at once).
KEEP_ALIVE_S = 65


def uvicorn_config(app, settings: ServerSettings):
    """uvicorn's configuration for ``app`` under ``settings`` (TLS included)."""
    import uvicorn

    tls = settings.tls.uvicorn_kwargs() if settings.tls else {}
    return uvicorn.Config(app, host=settings.host, port=settings.port, log_level=settings.log_level,
                          timeout_graceful_shutdown=settings.shutdown_timeout or None,
                          timeout_keep_alive=KEEP_ALIVE_S,
                          access_log=settings.log_level in ("debug", "trace"), **tls)


def lora_module(value: str) -> tuple[str, str]:
    """``NAME=PATH``, or vLLM's JSON ``{"name": NAME, "path": PATH, "base_model_name": ...}`` -> (name, path)."""
    if value.lstrip().startswith("{"):
        try:
            spec = json.loads(value)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(f"not a JSON object: {exc}") from None
        if not isinstance(spec, dict) or not isinstance(spec.get("name"), str) or not isinstance(spec.get("path"), str):
            raise argparse.ArgumentTypeError(f"a JSON LoRA module needs string 'name' and 'path', got {value}")
        return spec["name"], spec["path"]
    name, sep, path = value.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"expected NAME=PATH or a JSON object, got {value!r}")
    return name, path


def _name_list(value: str) -> tuple[str, ...]:
    """``a,b`` or vLLM's JSON form ``["a", "b"]``."""
    if value.lstrip().startswith("["):
        try:
            names = json.loads(value)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(f"not a JSON list: {exc}") from None
        if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
            raise argparse.ArgumentTypeError("must be a JSON list of strings")
        return tuple(names)
    return tuple(n.strip() for n in value.split(",") if n.strip())


def run(args: argparse.Namespace) -> int:
    from .app import create_app, drain_and_stop, launch_engine
    from .drain import DrainingServer
    from .process_engine import freeze_startup_objects

    configure_logging(args.log_level)
    settings = settings_from_args(args)
    engine = launch_engine(settings)
    # uvicorn re-raises the signal that stopped it once it has shut down; a SIGTERM handler that does
    # nothing turns that into a normal return, so a graceful stop exits 0.
    previous = signal.signal(signal.SIGTERM, lambda *_: None)
    try:
        print(startup_banner(engine.info, settings), flush=True)
        app = create_app(settings, engine)
        config = uvicorn_config(app, settings)
        freeze_startup_objects()
        DrainingServer(config, on_sigterm=lambda stop: drain_and_stop(app, stop)).run()
    finally:
        signal.signal(signal.SIGTERM, previous)
        engine.close()
    return 0


def startup_banner(info, settings: ServerSettings) -> str:
    auth = f"tenants from {settings.api_keys_file}" if settings.api_keys_file else "on" if settings.api_key else "off"
    kv_dtype = "" if settings.engine.kv_cache_dtype == "auto" else f" ({settings.engine.kv_cache_dtype})"
    return (f"podium serve: platform {info.platform_name}, model {info.model_name} "
            f"(max_model_len {info.max_model_len}), KV cache {info.kv_capacity_tokens} tokens{kv_dtype}, "
            f"engine in a {settings.engine_mode}\n"
            f"podium serve: listening on {settings.url}  (OpenAI base_url {settings.url}/v1, API key {auth})")
