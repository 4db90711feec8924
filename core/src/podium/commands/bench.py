"""``podium bench throughput | latency | serve``: performance numbers anyone can rerun.

    podium bench throughput --model smollm2-135m-instruct --num-prompts 32 --input-len 512 \\
        --output-len 128 --compare hf --json-out result.json
    podium bench latency --model llama-3.2-1b-shape --batch-size 8 --input-len 32 --output-len 128
    podium bench serve --base-url http://127.0.0.1:8000 --dataset sharegpt-like --request-rate 4
"""

from __future__ import annotations

import argparse
import asyncio
import math
import sys

from podium.config import DEFAULT_MODEL, DTYPES, KV_CACHE_DTYPES


def register(subparsers) -> None:
    bench = subparsers.add_parser("bench", help="benchmark throughput, latency or a running server")
    kinds = bench.add_subparsers(dest="bench_command", metavar="KIND")
    bench.set_defaults(func=lambda args: _usage(bench))
    throughput = kinds.add_parser("throughput", help="offline throughput, optionally against transformers")
    _add_engine_args(throughput)
    _add_dataset_args(throughput, input_len=512, output_len=128, num_prompts=100)
    throughput.add_argument("--backend", choices=("podium", "hf"), default="podium",
                            help="podium (default) or hf: transformers generate on the same requests")
    throughput.add_argument("--compare", choices=("hf",), default=None,
                            help="also run transformers in this process and print the ratio Podium/HF")
    throughput.add_argument("--hf-batch-size", type=int, default=64, help="transformers batch size (default 64)")
    throughput.add_argument("--disable-detokenize", action="store_true", help="Podium skips detokenizing outputs")
    _add_output_args(throughput)
    throughput.set_defaults(func=run_throughput_command)

    latency = kinds.add_parser("latency", help="prefill and per-token decode time of one batch")
    _add_engine_args(latency)
    latency.add_argument("--backend", choices=("podium", "hf"), default="podium")
    latency.add_argument("--batch-size", type=int, default=8)
    latency.add_argument("--input-len", type=int, default=32)
    latency.add_argument("--output-len", type=int, default=128)
    latency.add_argument("--num-iters", type=int, default=3, help="timed iterations; medians are reported")
    latency.add_argument("--num-iters-warmup", type=int, default=1)
    latency.add_argument("--seed", type=int, default=0, help="seeds the prompts and the engine")
    _add_output_args(latency)
    latency.set_defaults(func=run_latency_command)

    serve = kinds.add_parser("serve", help="load an OpenAI-compatible server (Podium, vLLM, llama.cpp, ...)")
    _add_serve_args(serve)
    _add_dataset_args(serve, input_len=512, output_len=128, num_prompts=100)
    _add_output_args(serve)
    serve.set_defaults(func=run_serve_command)


def _usage(parser: argparse.ArgumentParser) -> int:
    parser.print_help()
    return 2


def _add_engine_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("model and engine (passed to LLM)")
    group.add_argument("--model", default=DEFAULT_MODEL,
                       help="folder, .gguf, config.json, named shape (llama-3.1-8b-shape, ...) or "
                            f"{DEFAULT_MODEL} (default)")
    group.add_argument("--device", default=None, help="platform name (default: the best available)")
    group.add_argument("--dtype", choices=DTYPES, default="auto")
    group.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default="auto",
                       help="what the KV cache stores: auto (the model's dtype), fp8 (= fp8_e4m3), fp8_e5m2, ...")
    group.add_argument("--max-model-len", type=int, default=None)
    group.add_argument("--max-num-seqs", type=int, default=None)
    group.add_argument("--max-num-batched-tokens", type=int, default=None)
    group.add_argument("--kv-cache-memory", default=None, help="KV cache size where sized by amount, e.g. 4GiB")
    group.add_argument("--enforce-eager", action="store_true", help="no graph capture")
    group.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True)
    group.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                       help="overlap the host's work with the device's (default: the platform's choice)")
    group.add_argument("--threads", type=int, default=None,
                       help="torch CPU threads for both backends (default: torch's choice)")


def _add_dataset_args(parser: argparse.ArgumentParser, input_len: int, output_len: int, num_prompts: int) -> None:
    from podium.bench.datasets import DATASETS

    group = parser.add_argument_group("dataset")
    group.add_argument("--dataset", choices=DATASETS, default=None,
                       help="random (default), sharegpt-like, prefix-repetition, or file (with --dataset-path)")
    group.add_argument("--dataset-path", default=None, help="JSON or JSONL of {'prompt': ..., 'output_len': ...}")
    group.add_argument("--num-prompts", type=int, default=num_prompts)
    group.add_argument("--input-len", type=int, default=input_len)
    group.add_argument("--output-len", type=int, default=output_len)
    group.add_argument("--range-ratio", type=float, default=0.0,
                       help="random: lengths uniform in [len*(1-r), len*(1+r)]")
    group.add_argument("--prefix-len", type=int, default=256, help="prefix-repetition: shared prefix length")
    group.add_argument("--suffix-len", type=int, default=256, help="prefix-repetition: unique suffix length")
    group.add_argument("--num-prefixes", type=int, default=10, help="prefix-repetition: distinct prefixes")
    group.add_argument("--seed", type=int, default=0, help="seeds the dataset (and the engine)")


def _add_serve_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("server")
    group.add_argument("--base-url", default="http://127.0.0.1:8000", help="the server (with or without /v1)")
    group.add_argument("--model", default=None, help="the model name to send (default: the first in /v1/models)")
    group.add_argument("--tokenizer", default=None,
                       help="where datasets get the vocabulary and text: folder, .gguf, config, shape name "
                            f"(default: --model, else {DEFAULT_MODEL})")
    group.add_argument("--max-model-len", type=int, default=None, help="clip datasets to this context")
    group.add_argument("--endpoint", choices=("completions", "chat"), default="completions")
    group.add_argument("--request-rate", type=float, default=math.inf, help="requests/s, Poisson (default inf)")
    group.add_argument("--max-concurrency", type=int, default=None)
    group.add_argument("--ignore-eos", action="store_true", help="send ignore_eos (vLLM, Podium, llama.cpp)")
    group.add_argument("--temperature", type=float, default=0.0)
    group.add_argument("--api-key", default=None)
    group.add_argument("--timeout", type=float, default=6 * 3600.0, help="per-request timeout in seconds")
    group.add_argument("--percentiles", default="99", help="comma-separated, e.g. 50,90,99")


def _add_output_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json-out", default=None, help="write the full result (with the environment) here")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")
    parser.add_argument("--debug", action="store_true", help="show tracebacks")


def dataset_spec(args: argparse.Namespace):
    from podium.bench.datasets import DatasetSpec

    name = args.dataset or ("file" if args.dataset_path else "random")
    return DatasetSpec(name, args.num_prompts, args.input_len, args.output_len, args.range_ratio, args.prefix_len,
                       args.suffix_len, args.num_prefixes, args.dataset_path, args.seed)


def set_threads(threads: int | None) -> None:
    """``--threads``: torch's CPU thread count for this process (both backends)."""
    if threads is None:
        return
    if threads < 1:
        raise ValueError(f"--threads must be >= 1, got {threads}")
    import torch

    torch.set_num_threads(threads)


def engine_options(args: argparse.Namespace):
    from podium.bench.backends import EngineOptions

    return EngineOptions(args.model, args.device, args.dtype, args.max_model_len, args.max_num_seqs,
                         args.max_num_batched_tokens, args.enforce_eager, args.enable_prefix_caching,
                         args.kv_cache_memory, args.seed, args.async_scheduling, args.kv_cache_dtype)


def throughput_backends(args: argparse.Namespace) -> list[str]:
    if args.compare == "hf" and args.backend == "hf":
        raise ValueError("--compare hf compares Podium with transformers; drop --backend hf")
    return ["podium", "hf"] if args.compare == "hf" else [args.backend]


def _finish(payload: dict, text: str, json_out: str | None) -> int:
    from podium.bench.report import write_json

    print(text)
    if json_out:
        print(f"wrote {write_json(json_out, payload)}", file=sys.stderr)
    return 0


def run_throughput_command(args: argparse.Namespace) -> int:
    from podium.bench.throughput import format_throughput, run_throughput

    set_threads(args.threads)
    payload = run_throughput(engine_options(args), dataset_spec(args), throughput_backends(args), args.hf_batch_size,
                             detokenize=not args.disable_detokenize, progress=not args.no_progress)
    return _finish(payload, format_throughput(payload), args.json_out)


def run_latency_command(args: argparse.Namespace) -> int:
    from podium.bench.latency import format_latency, run_latency

    set_threads(args.threads)
    payload = run_latency(engine_options(args), args.backend, args.batch_size, args.input_len, args.output_len,
                          args.num_iters, args.num_iters_warmup, progress=not args.no_progress)
    return _finish(payload, format_latency(payload), args.json_out)


def parse_percentiles(text: str) -> tuple[float, ...]:
    try:
        values = tuple(float(p) for p in text.split(",") if p.strip())
    except ValueError:
        raise ValueError(f"--percentiles must be comma-separated numbers, got {text!r}") from None
    if not values:
        raise ValueError("--percentiles must name at least one percentile")
    return values


def run_serve_command(args: argparse.Namespace) -> int:
    from podium.bench.datasets import build_requests
    from podium.bench.report import environment
    from podium.bench.serve import ServeOptions, format_serve, run_requests, summarize_serve
    from podium.bench.serve_client import PayloadOptions
    from podium.bench.tokenizers import token_space_for

    spec = dataset_spec(args)
    options = ServeOptions(
        base_url=args.base_url,
        payload=PayloadOptions(args.endpoint, args.model or "", args.ignore_eos, args.temperature),
        request_rate=args.request_rate, max_concurrency=args.max_concurrency, seed=args.seed,
        timeout_s=args.timeout, api_key=args.api_key, percentiles=parse_percentiles(args.percentiles),
        progress=not args.no_progress,
    )
    space = token_space_for(args.tokenizer or args.model or DEFAULT_MODEL, args.max_model_len)
    requests = build_requests(spec, space)
    timings, duration, model = asyncio.run(run_requests(options, requests, space.tokenizer))
    summary = summarize_serve(options, timings, duration, model)
    payload = {"command": "serve", "environment": environment(None), "dataset": vars(spec), **summary}
    return _finish(payload, format_serve(summary, options.percentiles), args.json_out)
