"""``podium serve [MODEL]``: registered into the core's CLI through the ``podium.commands`` entry point.

Builds the settings from the flags, loads the engine before binding the port (so a bad model or
device fails at once, with the core's message), prints what was chosen, then runs uvicorn.
SIGTERM (and Ctrl-C) stop accepting connections, let in-flight requests finish (up to
``--shutdown-timeout`` seconds), stop the engine thread and exit 0.
"""

from __future__ import annotations

import argparse
import os
import signal

from podium.config import DEFAULT_MODEL, DTYPES, KV_CACHE_DTYPES, EngineConfig, parse_size

from .settings import ENGINE_MODES, LOG_LEVELS, ServerSettings


def register(subparsers) -> None:
    parser = subparsers.add_parser("serve", help="serve an OpenAI-compatible API",
                                   description="Serve MODEL through an OpenAI-compatible HTTP API.")
    parser.add_argument("model", nargs="?", default=DEFAULT_MODEL,
                        help=f"model folder, .gguf file or known name (default: {DEFAULT_MODEL})")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--device", default=None, help="platform name (default: the best available)")
    parser.add_argument("--dtype", default="auto", choices=DTYPES)
    parser.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES,
                        help="what the KV cache stores: auto (the model's dtype), fp8 (= fp8_e4m3), fp8_e5m2, ...")
    parser.add_argument("--api-key", default=os.environ.get("PODIUM_API_KEY"),
                        help="require 'Authorization: Bearer KEY' on the API (default: $PODIUM_API_KEY)")
    parser.add_argument("--served-model-name", default=None, help="the model name clients use")
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=None)
    parser.add_argument("--kv-cache-memory", default=None, help="KV-cache size in bytes or like 4GiB")
    parser.add_argument("--num-kv-blocks", type=int, default=None, help="exact number of KV-cache blocks")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.90)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--no-prefix-caching", action="store_true")
    parser.add_argument("--enforce-eager", action="store_true", help="no graph capture")
    parser.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                        help="plan and launch step N+1 before reading step N's tokens (default: the platform's "
                             "choice: on for CUDA/ROCm, off for CPU/TPU)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-request-bytes", default="16MiB", help="larger request bodies get 413")
    parser.add_argument("--shutdown-timeout", type=float, default=30.0,
                        help="seconds in-flight requests get to finish on SIGTERM")
    parser.add_argument("--engine-mode", default=ServerSettings.engine_mode, choices=ENGINE_MODES,
                        help="run the model steps in a child process or on a thread of the server "
                             f"(default: {ServerSettings.engine_mode}; measured in server/benchmarks/saturation.py)")
    parser.add_argument("--log-level", default="info", choices=LOG_LEVELS)
    parser.add_argument("--debug", action="store_true", help="show tracebacks")
    parser.set_defaults(func=run)


def settings_from_args(args: argparse.Namespace) -> ServerSettings:
    engine = EngineConfig(
        model=args.model, device=args.device, dtype=args.dtype, kv_cache_dtype=args.kv_cache_dtype, served_model_name=args.served_model_name,
        max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens, kv_cache_memory=args.kv_cache_memory,
        num_kv_blocks=args.num_kv_blocks, gpu_memory_utilization=args.gpu_memory_utilization,
        block_size=args.block_size, enable_prefix_caching=not args.no_prefix_caching,
        enforce_eager=args.enforce_eager, async_scheduling=args.async_scheduling, seed=args.seed)
    return ServerSettings(engine=engine, host=args.host, port=args.port, api_key=args.api_key or None,
                          log_level=args.log_level, max_request_bytes=parse_size(args.max_request_bytes),
                          shutdown_timeout=args.shutdown_timeout, engine_mode=args.engine_mode)


def run(args: argparse.Namespace) -> int:
    import uvicorn

    from .app import create_app, launch_engine
    from .process_engine import freeze_startup_objects

    settings = settings_from_args(args)
    engine = launch_engine(settings)
    # uvicorn re-raises the signal that stopped it once it has shut down; a SIGTERM handler that does
    # nothing turns that into a normal return, so a graceful stop exits 0.
    previous = signal.signal(signal.SIGTERM, lambda *_: None)
    try:
        print(startup_banner(engine.info, settings), flush=True)
        config = uvicorn.Config(create_app(settings, engine), host=settings.host, port=settings.port,
                                log_level=settings.log_level,
                                timeout_graceful_shutdown=settings.shutdown_timeout or None,
                                access_log=settings.log_level in ("debug", "trace"))
        freeze_startup_objects()
        uvicorn.Server(config).run()
    finally:
        signal.signal(signal.SIGTERM, previous)
        engine.close()
    return 0


def startup_banner(info, settings: ServerSettings) -> str:
    auth = "on" if settings.api_key else "off"
    kv_dtype = "" if settings.engine.kv_cache_dtype == "auto" else f" ({settings.engine.kv_cache_dtype})"
    return (f"podium serve: platform {info.platform_name}, model {info.model_name} "
            f"(max_model_len {info.max_model_len}), KV cache {info.kv_capacity_tokens} tokens{kv_dtype}, "
            f"engine in a {settings.engine_mode}\n"
            f"podium serve: listening on {settings.url}  (OpenAI base_url {settings.url}/v1, API key {auth})")

