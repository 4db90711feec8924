"""The router's benchmarks: each starts its replicas and routers, loads them with ``podium bench serve``,
and prints the comparison made in the same run.

    python benchmarks/router_bench.py prefix    # 3 replicas, 10 prefixes of 1,024 tokens + 256-token
                                                # suffixes, 200 requests: prefix-aware (ttft) vs
                                                # round-robin vs one replica alone (the hit-rate ceiling)
    python benchmarks/router_bench.py overhead  # one replica behind the router vs direct, sharegpt-like,
                                                # 1,000 requests, alternating rounds
    python benchmarks/router_bench.py mixed --fast-args "--device cuda" --slow-args "--device cpu"
                                                # a fast and a slow replica under a rising request rate:
                                                # p99 TTFT of ttft vs round-robin, and the slow one's share

``--serve-args`` go to every ``podium serve`` (model, device, memory); ``--small`` shrinks the
workload to check the script on a CPU. ``--summary FILE`` appends the tables there (the GPU session
writes ``$OUT/summary.txt``). Hit rates come from the replicas' own prefix-cache counters.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from contextlib import contextmanager
from pathlib import Path

BIN = Path(sys.executable).parent
PODIUM = str(BIN / "podium")


# -- processes ---------------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get(url: str, timeout: float = 5.0) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as response:
        return response.read().decode()


def wait_healthy(url: str, proc: subprocess.Popen, timeout: float = 900) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{url} exited with {proc.returncode} while starting")
        try:
            get(url + "/health", 2)
            return
        except OSError:
            time.sleep(0.5)
    raise RuntimeError(f"{url} was not healthy within {timeout:.0f} s")


@contextmanager
def processes(commands: list[list[str]], log_dir: Path):
    """Start every command (each gets ``--port``), wait until each answers /health, stop them after."""
    started = []
    try:
        for i, command in enumerate(commands):
            port = free_port()
            log = (log_dir / f"{Path(command[1]).name}-{i}-{port}.log").open("w")
            proc = subprocess.Popen([*command, "--port", str(port)], stdout=log, stderr=subprocess.STDOUT)
            started.append((proc, f"http://127.0.0.1:{port}"))
        for proc, url in started:
            wait_healthy(url, proc)
        yield [url for _, url in started]
    finally:
        for proc, _ in started:
            proc.send_signal(signal.SIGTERM)
        for proc, _ in started:
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()


def serve_command(args, extra: str = "") -> list[str]:
    return [PODIUM, "serve", *shlex.split(args.serve_args), *shlex.split(extra), "--log-level", "warning"]


def replicas(args, log_dir: Path, count: int, extra: str = ""):
    return processes([serve_command(args, extra)] * count, log_dir)


def router(urls: list[str], policy: str, log_dir: Path):
    command = [PODIUM, "router", "--policy", policy, "--log-level", "warning", "--poll-interval", "0.25"]
    for url in urls:
        command += ["--replica", url]
    return processes([command], log_dir)


# -- measuring ---------------------------------------------------------------------------------------
def bench(url: str, bench_args: list[str], log_dir: Path) -> dict:
    out = Path(tempfile.mkstemp(suffix=".json", dir=log_dir)[1])
    command = [PODIUM, "bench", "serve", "--base-url", url, "--no-progress", "--percentiles", "50,99",
               "--json-out", str(out), *bench_args]
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
    return json.loads(out.read_text())["results"]


def counter(metrics: str, name: str, label: str = "") -> float:
    pattern = rf"^{re.escape(name)}(?:_total)?(?:\{{([^}}]*)\}})? (\S+)$"
    return sum(float(value) for labels, value in re.findall(pattern, metrics, re.M) if label in (labels or ""))


def prefix_hits(urls: list[str]) -> tuple[float, float]:
    """(hit tokens, queried tokens) of the replicas' prefix caches, summed."""
    texts = [get(url + "/metrics") for url in urls]
    return (sum(counter(t, "podium:prefix_cache_hits") for t in texts),
            sum(counter(t, "podium:prefix_cache_queries") for t in texts))


def report(title: str, header: list[str], rows: list[list], summary: Path | None) -> None:
    widths = [max(len(str(x)) for x in column) for column in zip(header, *rows)]
    lines = [title, "  ".join(h.ljust(w) for h, w in zip(header, widths))]
    lines += ["  ".join(str(x).ljust(w) for x, w in zip(row, widths)) for row in rows]
    text = "\n".join(lines) + "\n"
    print(text, flush=True)
    if summary is not None:
        with summary.open("a") as f:
            f.write(text + "\n")


# -- the scenarios -----------------------------------------------------------------------------------
def run_prefix(args, log_dir: Path) -> None:
    prefix_len, suffix_len, prompts = (64, 16, 20) if args.small else (1024, 256, args.num_prompts)
    workload = ["--dataset", "prefix-repetition", "--num-prefixes", "10", "--prefix-len", str(prefix_len),
                "--suffix-len", str(suffix_len), "--num-prompts", str(prompts), "--output-len", str(args.output_len),
                "--request-rate", str(args.request_rate), "--seed", "0"]
    rows = []
    groups = (("ttft", args.replicas), ("round-robin", args.replicas), ("single replica", 1))
    # every policy gets replicas of its own (fresh caches), all started at once: the starts overlap
    with replicas(args, log_dir, sum(count for _, count in groups)) as every_url:
        for policy, count in groups:
            urls, every_url = every_url[:count], every_url[count:]
            if policy == "single replica":
                result = bench(urls[0], workload, log_dir)
            else:
                with router(urls, policy, log_dir) as (router_url,):
                    result = bench(router_url, workload, log_dir)
            hits, queries = prefix_hits(urls)
            rows.append([policy, count, f"{hits / max(queries, 1):.3f}", f"{result['mean_ttft_ms']:.1f}",
                         f"{result['p99_ttft_ms']:.1f}", result["completed"], result["failed"]])
    ratio = float(rows[1][3]) / max(float(rows[0][3]), 1e-9)
    report(f"prefix repetition (10 x {prefix_len} + {suffix_len}, {prompts} requests, "
           f"{args.request_rate} req/s): round-robin / ttft mean TTFT = {ratio:.2f}x",
           ["policy", "replicas", "hit_rate", "mean_ttft_ms", "p99_ttft_ms", "ok", "failed"], rows, args.summary)


def run_overhead(args, log_dir: Path) -> None:
    prompts = 8 if args.small else args.num_prompts
    dataset = ["--dataset", "random", "--input-len", "32", "--output-len", "8"] if args.small else \
        ["--dataset", "sharegpt-like"]
    workload = [*dataset, "--num-prompts", str(prompts), "--request-rate", str(args.request_rate), "--seed", "0"]
    rows, direct, routed = [], [], []
    with replicas(args, log_dir, 1) as urls, router(urls, "ttft", log_dir) as (router_url,):
        bench(urls[0], workload, log_dir)  # untimed: every timed run then meets the same prefix cache
        for round_ in range(args.rounds):
            order = [("direct", urls[0]), ("router", router_url)]
            for name, url in order if round_ % 2 == 0 else order[::-1]:
                result = bench(url, workload, log_dir)
                (direct if name == "direct" else routed).append(result)
                rows.append([round_, name, f"{result['output_throughput']:.1f}", f"{result['median_ttft_ms']:.2f}",
                             f"{result['p99_ttft_ms']:.1f}", result["failed"]])
    mean = lambda results, key: sum(r[key] for r in results) / len(results)  # noqa: E731
    throughput = mean(routed, "output_throughput") / mean(direct, "output_throughput")
    added_p50 = mean(routed, "median_ttft_ms") - mean(direct, "median_ttft_ms")
    report(f"router overhead ({dataset[1]}, {prompts} requests, rate {args.request_rate}): router/direct output "
           f"throughput = {throughput:.3f}, added p50 TTFT = {added_p50:.2f} ms",
           ["round", "path", "output_tok_s", "p50_ttft_ms", "p99_ttft_ms", "failed"], rows, args.summary)


def run_mixed(args, log_dir: Path) -> None:
    prompts = 6 if args.small else args.num_prompts
    input_len, output_len = (64, 8) if args.small else (args.input_len, args.output_len)
    rates = [float(r) for r in args.rates.split(",")]
    rows = []
    with processes([serve_command(args, args.fast_args), serve_command(args, args.slow_args)], log_dir) as (fast, slow):
        for rate in rates:
            for policy in ("ttft", "round-robin"):
                with router([fast, slow], policy, log_dir) as (router_url,):
                    workload = ["--dataset", "random", "--num-prompts", str(prompts), "--input-len",
                                str(input_len), "--output-len", str(output_len), "--request-rate",
                                str(rate), "--seed", str(int(rate * 10))]
                    result = bench(router_url, workload, log_dir)
                    metrics = get(router_url + "/metrics")
                routed = counter(metrics, "podium_router:requests")
                slow_share = counter(metrics, "podium_router:requests", f'replica="{slow}"') / max(routed, 1)
                rows.append([rate, policy, f"{result['p99_ttft_ms']:.1f}", f"{result['mean_ttft_ms']:.1f}",
                             f"{slow_share:.2f}", result["failed"]])
    report(f"mixed fleet ({args.fast_args!r} + {args.slow_args!r}; random {input_len}/{output_len}, "
           f"{prompts} requests per rate)", ["rate", "policy", "p99_ttft_ms", "mean_ttft_ms", "slow_share", "failed"],
           rows, args.summary)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("scenario", choices=("prefix", "overhead", "mixed"))
    parser.add_argument("--serve-args", default="--max-num-seqs 64",
                        help="podium serve options for every replica (model, --device, memory, ...)")
    parser.add_argument("--replicas", type=int, default=3, help="prefix: replicas behind the router")
    parser.add_argument("--num-prompts", type=int, default=None)
    parser.add_argument("--request-rate", default=None, help="requests/s (Poisson) or inf")
    parser.add_argument("--output-len", type=int, default=None)
    parser.add_argument("--input-len", type=int, default=512, help="mixed: prompt tokens")
    parser.add_argument("--rounds", type=int, default=2, help="overhead: direct/router rounds, order alternating")
    parser.add_argument("--fast-args", default="--device cuda", help="mixed: the fast replica's extra options")
    parser.add_argument("--slow-args", default="--device cpu", help="mixed: the slow replica's extra options")
    parser.add_argument("--rates", default="0.5,1,2,4,8,16", help="mixed: request rates, comma-separated")
    parser.add_argument("--small", action="store_true", help="a tiny workload: checks the script on a CPU")
    parser.add_argument("--log-dir", type=Path, default=None, help="keep the servers' logs here (default: dropped)")
    parser.add_argument("--summary", type=Path, default=Path(os.environ["OUT"]) / "summary.txt"
                        if os.environ.get("OUT") else None, help="append the tables here (default: $OUT/summary.txt)")
    args = parser.parse_args()
    defaults = {"prefix": (200, "4", 16), "overhead": (1000, "inf", None), "mixed": (200, None, 64)}[args.scenario]
    args.num_prompts = args.num_prompts or defaults[0]
    args.request_rate = args.request_rate or defaults[1]
    args.output_len = args.output_len or defaults[2] or 16
    with tempfile.TemporaryDirectory(prefix="router-bench-") as tmp:
        log_dir = args.log_dir or Path(tmp)
        log_dir.mkdir(parents=True, exist_ok=True)
        {"prefix": run_prefix, "overhead": run_overhead, "mixed": run_mixed}[args.scenario](args, log_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
