"""``podium bench throughput``: offline throughput of Podium and/or transformers on one request list.

Both backends get exactly the same requests (prompt token ids and output lengths, EOS ignored).
Podium warms up with a short generate on unrelated prompts; transformers with its first batch
(its first pass over new shapes is several times slower). Then the whole run is timed. With
``--compare hf`` both run in one process, one after the other, and the ratio Podium/transformers
is reported.
"""

from __future__ import annotations

import sys

from .backends import EngineOptions, Target, free_memory, hf_backend, podium_backend, target_of, target_without_engine
from .datasets import DatasetSpec, build_requests, summarize
from .metrics import ThroughputResult, ratios
from .report import environment, format_rows


def run_throughput(options: EngineOptions, spec: DatasetSpec, backends: list[str], hf_batch_size: int = 64,
                   detokenize: bool = True, progress: bool = True) -> dict:
    """Run ``backends`` (in order) on the dataset; returns the JSON-ready result."""
    if not backends:
        raise ValueError("no backend to run")
    results: dict[str, ThroughputResult] = {}
    target: Target | None = None
    requests = []
    if "podium" in backends:
        backend = podium_backend(options, detokenize)
        target = target_of(backend)
        requests = build_requests(spec, target.space)
        _log(f"podium: {len(requests)} requests, warming up")
        backend.warmup(requests)
        _log("podium: timing the run")
        results["podium"] = backend.run(requests, progress)
        _check_counts(results["podium"], requests)
        backend = None
        free_memory(target.platform)
    if "hf" in backends:
        target = target or target_without_engine(options)
        requests = requests or build_requests(spec, target.space)
        backend = hf_backend(options, target, hf_batch_size)
        _log(f"transformers: {len(requests)} requests, batch {hf_batch_size}, warming up")
        backend.warmup(requests)
        _log("transformers: timing the run")
        results["hf"] = backend.run(requests, progress)
        backend = None
        free_memory(target.platform)
    payload = {
        "command": "throughput",
        "environment": environment(target.platform_name, target.platform),
        "config": {
            **options.as_dict(),
            "resolved_dtype": str(target.dtype).replace("torch.", ""),
            "resolved_device": str(target.device),
            "dataset": vars(spec),
            "hf_batch_size": hf_batch_size if "hf" in backends else None,
            "detokenize": detokenize,
        },
        "dataset_stats": summarize(requests),
        "results": {name: r.as_dict() for name, r in results.items()},
    }
    if "podium" in results and "hf" in results:
        payload["ratio_podium_over_hf"] = ratios(results["podium"], results["hf"])
    return payload


def _check_counts(result: ThroughputResult, requests) -> None:
    expected = sum(r.output_len for r in requests)
    if result.output_tokens != expected:
        print(f"warning: podium produced {result.output_tokens} output tokens, the requests asked for {expected}",
              file=sys.stderr)


def _log(message: str) -> None:
    print(f"[podium bench] {message}", file=sys.stderr, flush=True)


def format_throughput(payload: dict) -> str:
    stats = payload["dataset_stats"]
    rows: list[tuple[str, object]] = [
        ("Model", payload["config"]["model"]),
        ("Dataset", payload["config"]["dataset"]["name"]),
        ("Requests", stats["num_requests"]),
        ("Mean input / output tokens", f"{stats['mean_input_len']:.0f} / {stats['mean_output_len']:.0f}"),
        ("dtype / device", f"{payload['config']['resolved_dtype']} / {payload['config']['resolved_device']}"),
    ]
    if payload["config"].get("kv_cache_dtype", "auto") != "auto":
        rows.append(("Podium KV cache dtype", payload["config"]["kv_cache_dtype"]))
    names = {"podium": "Podium", "hf": "transformers"}
    for name, r in payload["results"].items():
        rows += [
            (f"--- {names[name]}", ""),
            ("Elapsed (s)", r["elapsed_s"]),
            ("Requests/s", r["requests_per_s"]),
            ("Total tokens/s", r["total_tokens_per_s"]),
            ("Output tokens/s", r["output_tokens_per_s"]),
        ]
    if "ratio_podium_over_hf" in payload:
        ratio = payload["ratio_podium_over_hf"]
        rows += [("--- Podium / transformers", ""), ("Output tokens/s ratio", ratio["output_tokens_per_s"]),
                 ("Total tokens/s ratio", ratio["total_tokens_per_s"])]
    return format_rows("Throughput Benchmark Result", rows)
