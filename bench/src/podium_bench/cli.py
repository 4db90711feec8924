"""``podium bench throughput | latency | serve``: performance numbers anyone can rerun.

    podium bench throughput --model smollm2-135m-instruct --num-prompts 32 --input-len 512 \\
        --output-len 128 --compare hf --json-out result.json
    podium bench latency --model llama-3.2-1b-shape --batch-size 8 --input-len 32 --output-len 128
    podium bench serve --base-url http://127.0.0.1:8000 --dataset sharegpt-like --request-rate 4

``throughput`` and ``latency`` build an engine from the core's engine flags (``podium.engine_flags``,
the same definition ``podium serve`` uses). vLLM's ``vllm bench`` flag names work as aliases
(``--dataset-name``, ``--random-input-len``, ``--random-output-len``, ``--metric-percentiles``,
``--save-result``, ``--result-filename``, ...), plus its ``--burstiness`` and ``--goodput``.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import sys

from podium.config import DEFAULT_MODEL
from podium.engine_flags import add_engine_flags, engine_kwargs

from .datasets import DATASETS
from .report import result_path

# vLLM's dataset names -> ours (a name not here and not ours is refused with the choices)
DATASET_ALIASES = {"prefix_repetition": "prefix-repetition", "custom": "file", "sharegpt_like": "sharegpt-like"}


def register(subparsers) -> None:
    bench = subparsers.add_parser("bench", help="benchmark throughput, latency or a running server")
    kinds = bench.add_subparsers(dest="bench_command", metavar="KIND")
    bench.set_defaults(func=lambda args: _usage(bench))
    throughput = kinds.add_parser("throughput", help="offline throughput, optionally against transformers")
    add_engine_flags(throughput)
    _add_dataset_args(throughput, input_len=512, output_len=128, num_prompts=100)
    options = throughput.add_argument_group("throughput")
    options.add_argument("--backend", choices=("podium", "hf"), default="podium",
                         help="podium, or hf: transformers generate on the same requests (default: podium)")
    options.add_argument("--compare", choices=("hf",), default=None,
                         help="also run transformers in this process and print the ratio Podium/HF (default: off)")
    options.add_argument("--hf-batch-size", type=int, default=64, help="transformers batch size (default: 64)")
    options.add_argument("--disable-detokenize", action="store_true",
                         help="Podium skips detokenizing outputs (default: off)")
    _add_threads(options)
    _add_output_args(throughput)
    throughput.set_defaults(func=run_throughput_command)

    latency = kinds.add_parser("latency", help="prefill and per-token decode time of one batch")
    add_engine_flags(latency)
    options = latency.add_argument_group("latency")
    options.add_argument("--backend", choices=("podium", "hf"), default="podium", help="(default: podium)")
    options.add_argument("--batch-size", type=int, default=8, help="(default: 8)")
    options.add_argument("--input-len", type=int, default=32, help="(default: 32)")
    options.add_argument("--output-len", type=int, default=128, help="(default: 128)")
    options.add_argument("--num-iters", type=int, default=3, help="timed iterations; medians are reported (default: 3)")
    options.add_argument("--num-iters-warmup", type=int, default=1, help="(default: 1)")
    _add_threads(options)
    _add_output_args(latency)
    latency.set_defaults(func=run_latency_command)

    serve = kinds.add_parser("serve", help="load an OpenAI-compatible server (Podium, vLLM, llama.cpp, ...)")
    _add_serve_args(serve)
    _add_dataset_args(serve, input_len=512, output_len=128, num_prompts=100, seed=True)
    _add_output_args(serve)
    serve.set_defaults(func=run_serve_command)


def _usage(parser: argparse.ArgumentParser) -> int:
    parser.print_help()
    return 2


def _add_threads(group) -> None:
    group.add_argument("--threads", type=int, default=None,
                       help="torch CPU threads for both backends (default: torch's choice)")


def dataset_name(text: str) -> str:
    """``--dataset``'s value: ours, or vLLM's name for the same workload."""
    name = DATASET_ALIASES.get(text, text)
    if name in DATASETS:
        return name
    if text == "sharegpt":
        raise argparse.ArgumentTypeError("there is no 'sharegpt' dataset here (vLLM's reads the ShareGPT JSON): use "
                                         "sharegpt-like (synthetic, ShareGPT's lengths) or file with --dataset-path")
    raise argparse.ArgumentTypeError(f"unknown dataset {text!r}; choose one of {', '.join(DATASETS)} "
                                     f"(vLLM's {', '.join(DATASET_ALIASES)} work too)")


def _add_dataset_args(parser: argparse.ArgumentParser, input_len: int, output_len: int, num_prompts: int,
                      seed: bool = False) -> None:
    group = parser.add_argument_group("dataset")
    group.add_argument("--dataset", "--dataset-name", type=dataset_name, default=None, metavar="NAME",
                       help=f"{', '.join(DATASETS)} (file needs --dataset-path) (default: random, or file "
                            "when --dataset-path is given)")
    group.add_argument("--dataset-path", default=None,
                       help="JSON or JSONL of {'prompt': ..., 'output_len': ...} (default: none)")
    group.add_argument("--num-prompts", type=int, default=num_prompts, help=f"(default: {num_prompts})")
    group.add_argument("--input-len", "--random-input-len", type=int, default=input_len,
                       help=f"prompt tokens (default: {input_len})")
    group.add_argument("--output-len", "--random-output-len", type=int, default=output_len,
                       help=f"output tokens (default: {output_len})")
    group.add_argument("--range-ratio", "--random-range-ratio", type=float, default=0.0,
                       help="random: lengths uniform in [len*(1-r), len*(1+r)] (default: 0)")
    group.add_argument("--prefix-len", "--prefix-repetition-prefix-len", type=int, default=256,
                       help="prefix-repetition: shared prefix length (default: 256)")
    group.add_argument("--suffix-len", "--prefix-repetition-suffix-len", type=int, default=256,
                       help="prefix-repetition: unique suffix length (default: 256)")
    group.add_argument("--num-prefixes", "--prefix-repetition-num-prefixes", type=int, default=10,
                       help="prefix-repetition: distinct prefixes (default: 10)")
    if seed:  # throughput and latency seed the dataset with the engine's --seed
        group.add_argument("--seed", type=int, default=0, help="seeds the dataset and the arrivals (default: 0)")


def _add_serve_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("server")
    group.add_argument("--base-url", default="http://127.0.0.1:8000",
                       help="the server, with or without /v1 (default: http://127.0.0.1:8000)")
    group.add_argument("--model", default=None, help="the model name to send (default: the first in /v1/models)")
    group.add_argument("--tokenizer", default=None,
                       help="where datasets get the vocabulary and text: folder, .gguf, config, shape name (default: "
                            f"the served model where it resolves here, else {DEFAULT_MODEL})")
    group.add_argument("--max-model-len", type=int, default=None,
                       help="clip datasets to this context (default: the tokenizer's model's)")
    group.add_argument("--endpoint", choices=("completions", "chat"), default="completions",
                       help="(default: completions)")
    group.add_argument("--request-rate", type=float, default=math.inf, help="requests per second (default: inf)")
    group.add_argument("--burstiness", type=float, default=1.0,
                       help="shape of the gamma-distributed gaps between arrivals: 1 is Poisson, lower burstier, "
                            "higher more even (default: 1)")
    group.add_argument("--max-concurrency", type=int, default=None, help="(default: unlimited)")
    group.add_argument("--ignore-eos", action="store_true",
                       help="send ignore_eos (vLLM, Podium, llama.cpp) (default: off)")
    group.add_argument("--temperature", type=float, default=0.0, help="(default: 0)")
    group.add_argument("--api-key", default=None, help="(default: none)")
    group.add_argument("--timeout", type=float, default=6 * 3600.0,
                       help="per-request timeout in seconds (default: 21600)")
    group.add_argument("--percentiles", "--metric-percentiles", default="99",
                       help="comma-separated, e.g. 50,90,99 (default: 99)")
    group.add_argument("--goodput", nargs="+", default=None, metavar="KEY:MS",
                       help="service-level objectives for goodput, e.g. ttft:500 tpot:50 (keys ttft, tpot, e2el; "
                            "milliseconds) (default: none)")


def _add_output_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("output")
    group.add_argument("--json-out", "--output-json", default=None,
                       help="write the full result (with the environment) here (default: none)")
    group.add_argument("--save-result", action="store_true",
                       help="write the result as JSON to --result-filename, else an automatic name (default: off)")
    group.add_argument("--result-filename", default=None,
                       help="with --save-result: the file name (default: COMMAND-MODEL-DATE.json)")
    group.add_argument("--result-dir", default=None, help="with --save-result: the folder (default: .)")
    group.add_argument("--no-progress", action="store_true", help="no progress bars (default: off)")
    group.add_argument("--debug", action="store_true", help="show tracebacks (default: off)")


def dataset_spec(args: argparse.Namespace, seed: int | None = None):
    from .datasets import DatasetSpec

    name = args.dataset or ("file" if args.dataset_path else "random")
    seed = args.seed if seed is None else seed
    return DatasetSpec(name, args.num_prompts, args.input_len, args.output_len, args.range_ratio, args.prefix_len,
                       args.suffix_len, args.num_prefixes, args.dataset_path, seed)


def set_threads(threads: int | None) -> None:
    """``--threads``: torch's CPU thread count for this process (both backends)."""
    if threads is None:
        return
    if threads < 1:
        raise ValueError(f"--threads must be >= 1, got {threads}")
    import torch

    torch.set_num_threads(threads)


def engine_options(args: argparse.Namespace):
    from .backends import EngineOptions

    return EngineOptions(engine_kwargs(args))


def throughput_backends(args: argparse.Namespace) -> list[str]:
    if args.compare == "hf" and args.backend == "hf":
        raise ValueError("--compare hf compares Podium with transformers; drop --backend hf")
    return ["podium", "hf"] if args.compare == "hf" else [args.backend]


def _finish(payload: dict, text: str, args: argparse.Namespace, model: str) -> int:
    from .report import write_json

    print(text)
    for path in filter(None, (args.json_out, result_path(args, payload["command"], model))):
        print(f"wrote {write_json(path, payload)}", file=sys.stderr)
    return 0


def run_throughput_command(args: argparse.Namespace) -> int:
    from .throughput import format_throughput, run_throughput

    set_threads(args.threads)
    options = engine_options(args)
    payload = run_throughput(options, dataset_spec(args, options.config.seed), throughput_backends(args),
                             args.hf_batch_size, detokenize=not args.disable_detokenize, progress=not args.no_progress)
    return _finish(payload, format_throughput(payload), args, options.config.model)


def run_latency_command(args: argparse.Namespace) -> int:
    from .latency import format_latency, run_latency

    set_threads(args.threads)
    options = engine_options(args)
    payload = run_latency(options, args.backend, args.batch_size, args.input_len, args.output_len,
                          args.num_iters, args.num_iters_warmup, progress=not args.no_progress)
    return _finish(payload, format_latency(payload), args, options.config.model)


def parse_percentiles(text: str) -> tuple[float, ...]:
    try:
        values = tuple(float(p) for p in text.split(",") if p.strip())
    except ValueError:
        raise ValueError(f"--percentiles must be comma-separated numbers, got {text!r}") from None
    if not values:
        raise ValueError("--percentiles must name at least one percentile")
    return values


def serve_options(args: argparse.Namespace):
    from .metrics import parse_goodput
    from .serve import ServeOptions
    from .serve_client import PayloadOptions

    return ServeOptions(
        base_url=args.base_url,
        payload=PayloadOptions(args.endpoint, args.model or "", args.ignore_eos, args.temperature),
        request_rate=args.request_rate, burstiness=args.burstiness, max_concurrency=args.max_concurrency,
        seed=args.seed, timeout_s=args.timeout, api_key=args.api_key, percentiles=parse_percentiles(args.percentiles),
        goodput=parse_goodput(args.goodput), progress=not args.no_progress,
    )


def run_serve_command(args: argparse.Namespace) -> int:
    from .datasets import build_requests
    from .report import environment
    from .serve import format_serve, run_requests, served_model, summarize_serve
    from .tokenizers import token_space_for_served

    spec = dataset_spec(args)
    options, names = asyncio.run(served_model(serve_options(args)))
    space = token_space_for_served(args.tokenizer, names, args.max_model_len)
    requests = build_requests(spec, space)
    timings, duration, model = asyncio.run(run_requests(options, requests, space.tokenizer))
    summary = summarize_serve(options, timings, duration, model)
    payload = {"command": "serve", "environment": environment(None), "dataset": vars(spec), **summary}
    return _finish(payload, format_serve(summary, options.percentiles), args, model)
