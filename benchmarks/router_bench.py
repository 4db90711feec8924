"""The router's benchmarks: each starts its replicas and routers, loads them with ``podium bench serve``,
and prints the comparison made in the same run.

    python benchmarks/router_bench.py prefix    # 3 replicas, 10 prefixes of 1,024 tokens + 256-token
                                                # suffixes, 200 requests: prefix-aware (ttft) vs
                                                # round-robin vs one replica alone (the hit-rate ceiling),
                                                # each of the 3 with KV room for 4.5 prefixes, the one
                                                # alone with the 3's total (--cache-prefixes);
                                                # --rates 6,12,18: each rate's workload its own seed
    python benchmarks/router_bench.py overhead  # one replica behind the router vs direct, sharegpt-like,
                                                # 1,000 requests, alternating rounds
    python benchmarks/router_bench.py mixed --fast-args "--device cuda" --slow-args "--device cpu"
                                                # a fast and a slow replica under a rising request rate:
                                                # p99 TTFT of ttft vs round-robin, and the slow one's share

``--serve-args`` go to every ``podium serve`` (model, device, memory); ``--small`` shrinks the
workload to check the script on a CPU. Each table row is printed as it is measured, the table at the
end. ``--summary FILE`` appends the tables there (the GPU sessions write ``$OUT/summary.txt``). Hit
rates come from the replicas' own prefix-cache counters, counted over each run alone.
"""

from __future__ import annotations

import argparse
import json
import math
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
from contextlib import contextmanager, nullcontext
from pathlib import Path

BIN = Path(sys.executable).parent
PODIUM = str(BIN / "podium")
BLOCK_SIZE = 16  # podium serve's default --block-size: the prefix cache's unit


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
            kind = next(Path(word).name for word in command if word in ("serve", "router"))
            log = (log_dir / f"{kind}-{i}-{port}.log").open("w")
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


def serve_command(args, extra: str = "", env: str = "") -> list[str]:
    """``podium serve`` with the common --serve-args and ``extra``; ``env`` ("NAME=VALUE ...") for it alone."""
    prefix = ["env", *shlex.split(env)] if env else []
    return [*prefix, PODIUM, "serve", *shlex.split(args.serve_args), *shlex.split(extra), "--log-level", "warning"]


def replicas(args, log_dir: Path, count: int, extra: str = ""):
    return processes([serve_command(args, extra)] * count, log_dir)


def router(urls: list[str], policy: str, log_dir: Path, extra: str = ""):
    command = [PODIUM, "router", "--policy", policy, "--log-level", "warning", "--poll-interval", "0.25",
               *shlex.split(extra)]
    for url in urls:
        command += ["--replica", url]
    return processes([command], log_dir)


# -- measuring ---------------------------------------------------------------------------------------
def bench(url: str, bench_args: list[str], log_dir: Path) -> dict:
    return bench_all([url], bench_args, log_dir)[0]


def bench_all(urls: list[str], bench_args: list[str], log_dir: Path, more: list[list[str]] | None = None) -> list[dict]:
    """The same workload against each URL at once (one client process each); ``more``: each URL's own
    extra arguments (given last, so they win)."""
    outs = [Path(tempfile.mkstemp(suffix=".json", dir=log_dir)[1]) for _ in urls]
    procs = [subprocess.Popen([PODIUM, "bench", "serve", "--base-url", url, "--no-progress", "--percentiles", "50,99",
                               "--json-out", str(out), *bench_args, *extra], stdout=subprocess.DEVNULL)
             for url, out, extra in zip(urls, outs, more or [[] for _ in urls])]
    failed = [proc.args for proc in procs if proc.wait() != 0]
    if failed:
        raise subprocess.CalledProcessError(1, failed[0])
    return [json.loads(out.read_text())["results"] for out in outs]


def counter(metrics: str, name: str, label: str = "") -> float:
    pattern = rf"^{re.escape(name)}(?:_total)?(?:\{{([^}}]*)\}})? (\S+)$"
    return sum(float(value) for labels, value in re.findall(pattern, metrics, re.M) if label in (labels or ""))


def prefix_hits(urls: list[str]) -> tuple[float, float]:
    """(hit tokens, queried tokens) of the replicas' prefix caches, summed."""
    texts = [get(url + "/metrics") for url in urls]
    return (sum(counter(t, "podium:prefix_cache_hits") for t in texts),
            sum(counter(t, "podium:prefix_cache_queries") for t in texts))


class Rows(list):
    """A table's rows, each printed as it is measured: a step cut off by its time limit still shows
    what it measured."""

    def __init__(self, *header: str) -> None:
        super().__init__()
        self.header = list(header)

    def append(self, row: list) -> None:
        super().append(row)
        print("measured: " + ", ".join(f"{h} {x}" for h, x in zip(self.header, row)), flush=True)


def report(title: str, rows: Rows, summary: Path | None, notes: list[str] = ()) -> None:
    header = rows.header
    widths = [max(len(str(x)) for x in column) for column in zip(header, *rows)]
    lines = [title, "  ".join(h.ljust(w) for h, w in zip(header, widths))]
    lines += ["  ".join(str(x).ljust(w) for x, w in zip(row, widths)) for row in rows]
    lines += list(notes)
    text = "\n".join(lines) + "\n"
    print(text, flush=True)
    if summary is not None:
        with summary.open("a") as f:
            f.write(text + "\n")


# -- the prefix scenario -----------------------------------------------------------------------------
class DeviceLoad:
    """What the device did while a run lasted, from ``nvidia-smi`` sampled every 200 ms: ``busy``, the
    mean share of time a kernel ran, and ``peak_gib``, the most memory in use (both None without it)."""

    def __enter__(self):
        query = ["nvidia-smi", "--query-gpu=utilization.gpu,memory.used", "--format=csv,noheader,nounits",
                 "-i", "0", "-lms", "200"]
        try:
            self.proc = subprocess.Popen(query, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        except OSError:
            self.proc = None
        self.busy = self.peak_gib = None
        return self

    def __exit__(self, *exc) -> None:
        if self.proc is None:
            return
        self.proc.terminate()
        samples = [line.split(",") for line in self.proc.communicate()[0].splitlines()]
        samples = [(float(busy), float(used)) for busy, used in (s for s in samples if len(s) == 2)
                   if busy.strip().isdigit() and used.strip().isdigit()]
        if samples:
            self.busy = sum(busy for busy, _ in samples) / len(samples) / 100
            self.peak_gib = max(used for _, used in samples) / 1024


def device_columns(load: DeviceLoad | None) -> list[str]:
    if load is None or load.busy is None:
        return ["-", "-"]
    return [f"{load.busy:.2f}", f"{load.peak_gib:.1f}"]


def prefix_workload(args, rate: str, seed: int, prompts: int, prefixes: int = 10) -> list[str]:
    prefix_len, suffix_len = (64, 16) if args.small else (1024, 256)
    return ["--dataset", "prefix-repetition", "--num-prefixes", str(prefixes), "--prefix-len", str(prefix_len),
            "--suffix-len", str(suffix_len), "--num-prompts", str(prompts), "--output-len", str(args.output_len),
            "--request-rate", rate, "--seed", str(seed)]


def run_prefix(args, log_dir: Path) -> None:
    prefix_len, suffix_len, prompts = (64, 16, 20) if args.small else (1024, 256, args.num_prompts)
    rates = args.rates.split(",") if args.rates else [args.request_rate]
    deadline = time.time() + args.time_limit if args.time_limit else math.inf
    # Cache pressure: each replica has KV room for only ``cache_prefixes`` of the ten prefixes, so
    # round-robin keeps evicting prefixes its replicas will need again, while prefix-aware routing
    # can keep each prefix on one replica. The single replica (the hit-rate ceiling) gets the three's
    # total, so the comparison is at equal cache. 0: the --serve-args' own sizing.
    blocks = math.ceil(args.cache_prefixes * prefix_len / BLOCK_SIZE) if args.cache_prefixes else 0
    # (such a cache holds fewer tokens than the model's context: the context shrinks to the cache)
    context = "--max-model-len" in args.serve_args
    kv = lambda count: "" if not blocks else f"--num-kv-blocks {blocks * count}" + (  # noqa: E731
        "" if context else f" --max-model-len {blocks * BLOCK_SIZE}")
    rows = Rows("rate", "policy", "replicas", "kv_blocks", "hit_rate", "mean_ttft_ms", "p99_ttft_ms", "gpu_busy",
                "gpu_gib", "ok", "failed")
    groups = [group for group in (("ttft", args.replicas, kv(1)), ("round-robin", args.replicas, kv(1)),
                                  ("single", 1, kv(args.replicas))) if group[0] in args.groups.split(",")]
    notes = []

    def measure(policy: str, urls: list[str]) -> None:
        """Every rate on these replicas. Rate i's workload has seed i, the same for every group, so
        each policy meets the same requests at the same moments; its ten prefixes are new to the
        replicas, whose earlier blocks are evicted first (least recently used): a fresh cache."""
        for seed, rate in enumerate(rates):
            left = deadline - time.time()
            if left < prompts / float(rate) + 20:
                notes.append(f"{policy} at {rate}/s skipped: {left:.0f} s left of --time-limit")
                print(notes[-1], flush=True)
                continue
            hits, queries = prefix_hits(urls)
            with DeviceLoad() if args.gpu_busy else nullcontext() as load:
                if policy == "single":
                    result = bench(urls[0], prefix_workload(args, rate, seed, prompts), log_dir)
                else:
                    with router(urls, policy, log_dir, args.router_args) as (router_url,):
                        result = bench(router_url, prefix_workload(args, rate, seed, prompts), log_dir)
            hits, queries = (now - before for now, before in zip(prefix_hits(urls), (hits, queries)))
            rows.append([rate, policy, len(urls), blocks * (args.replicas if policy == "single" else 1) or "-",
                         f"{hits / max(queries, 1):.3f}", f"{result['mean_ttft_ms']:.1f}",
                         f"{result['p99_ttft_ms']:.1f}", *device_columns(load), result["completed"], result["failed"]])

    def warm_up(urls: list[str]) -> str:
        """Untimed: each replica prefills whole prompts, then prompts whose prefix it holds (at 4/s
        the earlier ones have finished), so kernels built on first use are not timed; these
        prefixes (another seed) never come back."""
        if args.warmup:
            bench_all(urls, prefix_workload(args, "4", 1000, args.warmup, prefixes=2), log_dir)
            hits, queries = prefix_hits(urls)
            return f" (hit rate {hits / max(queries, 1):.2f})"
        return ""

    def run_group(policy: str, urls: list[str], began: float) -> None:
        ready = time.time()
        warmed = warm_up(urls)
        warm = time.time()
        measure(policy, urls)
        notes.append(f"{policy}: replicas ready in {ready - began:.0f} s, warm-up {warm - ready:.0f} s{warmed}, "
                     f"runs {time.time() - warm:.0f} s")
        print(notes[-1], flush=True)

    commands = lambda group: [serve_command(args, group[2])] * group[1]  # noqa: E731
    if args.one_group_at_a_time:  # only one group's replicas exist at a time (a device that holds one group)
        for group in groups:
            if deadline - time.time() < 60:
                notes.append(f"{group[0]} skipped: {deadline - time.time():.0f} s left of --time-limit")
                continue
            began = time.time()
            with processes(commands(group), log_dir) as urls:
                run_group(group[0], urls, began)
    else:  # every group's replicas (fresh caches each) started at once: the starts overlap
        began = time.time()
        with processes([c for group in groups for c in commands(group)], log_dir) as every_url:
            for group in groups:
                urls, every_url = every_url[:group[1]], every_url[group[1]:]
                run_group(group[0], urls, began)
                began = time.time()
    room = (f"KV blocks per replica: {blocks} (room for {args.cache_prefixes:g} of the 10 prefixes; the single "
            f"replica {blocks * args.replicas}, the {args.replicas} replicas' total)") if blocks else \
        "KV blocks as --serve-args size them"
    title = (f"prefix repetition (10 x {prefix_len} + {suffix_len}, {prompts} requests, Poisson arrivals, output "
             f"{args.output_len}); {room}")
    report(title, rows, args.summary, notes + prefix_ratios(rows))


def prefix_ratios(rows: Rows) -> list[str]:
    """Per rate: round-robin's mean and p99 TTFT over prefix-aware routing's, and the latter's hit
    rate against the single replica's (the issue's two goals: >= 2x, within 10%)."""
    lines = []
    for rate in dict.fromkeys(row[0] for row in rows):
        by_policy = {row[1]: row for row in rows if row[0] == rate}
        ttft, rr, single = (by_policy.get(name) for name in ("ttft", "round-robin", "single"))
        parts = []
        if ttft and rr:
            parts.append(f"round-robin / ttft TTFT: mean {float(rr[5]) / float(ttft[5]):.2f}x, "
                         f"p99 {float(rr[6]) / float(ttft[6]):.2f}x")
        if ttft and single:
            parts.append(f"ttft hit rate {float(ttft[4]) / max(float(single[4]), 1e-9):.1%} of single's")
        if parts:
            lines.append(f"rate {rate}/s: " + "; ".join(parts))
    return lines


# -- the other scenarios -----------------------------------------------------------------------------
def run_overhead(args, log_dir: Path) -> None:
    prompts = 8 if args.small else args.num_prompts
    dataset = ["--dataset", "random", "--input-len", "32", "--output-len", "8"] if args.small else \
        ["--dataset", "sharegpt-like"]
    workload = [*dataset, "--num-prompts", str(prompts), "--request-rate", str(args.request_rate), "--seed", "0"]
    rows, direct, routed = Rows("round", "path", "output_tok_s", "p50_ttft_ms", "p99_ttft_ms", "failed"), [], []
    with replicas(args, log_dir, 1) as urls, router(urls, "ttft", log_dir) as (router_url,):
        bench(urls[0], workload, log_dir)  # untimed: every timed run then meets the same prefix cache
        if args.paired:  # both paths at once, each half the requests at half the rate: drift hits both
            half = [*dataset, "--num-prompts", str(max(prompts // 2, 1)), "--request-rate",
                    str(float(args.request_rate) / 2)]
            for round_ in range(args.rounds):  # the two seeds' prompts swap paths every round
                seeds = [["--seed", "0"], ["--seed", "1"]][:: 1 if round_ % 2 == 0 else -1]
                for name, result in zip(("direct", "router"), bench_all([urls[0], router_url], half, log_dir, seeds)):
                    (direct if name == "direct" else routed).append(result)
                    rows.append([round_, name, f"{result['output_throughput']:.1f}",
                                 f"{result['median_ttft_ms']:.2f}", f"{result['p99_ttft_ms']:.1f}", result["failed"]])
        for round_ in range(0 if args.paired else args.rounds):
            order = [("direct", urls[0]), ("router", router_url)]
            for name, url in order if round_ % 2 == 0 else order[::-1]:
                result = bench(url, workload, log_dir)
                (direct if name == "direct" else routed).append(result)
                rows.append([round_, name, f"{result['output_throughput']:.1f}", f"{result['median_ttft_ms']:.2f}",
                             f"{result['p99_ttft_ms']:.1f}", result["failed"]])
    mean = lambda results, key: sum(r[key] for r in results) / len(results)  # noqa: E731
    throughput = mean(routed, "output_throughput") / mean(direct, "output_throughput")
    added_p50 = mean(routed, "median_ttft_ms") - mean(direct, "median_ttft_ms")
    paired = ", paired: both paths at once, half the requests and rate each" if args.paired else ""
    report(f"router overhead ({dataset[1]}, {prompts} requests, rate {args.request_rate}{paired}): router/direct output "
           f"throughput = {throughput:.3f}, added p50 TTFT = {added_p50:.2f} ms", rows, args.summary)


def run_mixed(args, log_dir: Path) -> None:
    prompts = 6 if args.small else args.num_prompts
    input_len, output_len = (64, 8) if args.small else (args.input_len, args.output_len)
    rates = [float(r) for r in args.rates.split(",")]
    rows = Rows("rate", "policy", "p99_ttft_ms", "mean_ttft_ms", "slow_share", "failed")
    commands = [serve_command(args, args.fast_args), serve_command(args, args.slow_args, args.slow_env)]
    with processes(commands, log_dir) as (fast, slow):
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
           f"{prompts} requests per rate)", rows, args.summary)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("scenario", choices=("prefix", "overhead", "mixed"))
    parser.add_argument("--serve-args", default="--max-num-seqs 64",
                        help="podium serve options for every replica (model, --device, memory, ...)")
    parser.add_argument("--replicas", type=int, default=3, help="prefix: replicas behind the router")
    parser.add_argument("--cache-prefixes", type=float, default=4.5,
                        help="prefix: KV blocks per replica for this many of the 10 prefixes (--num-kv-blocks; "
                             "the single replica gets the replicas' total); 0: --serve-args size the cache")
    parser.add_argument("--groups", default="ttft,round-robin,single",
                        help="prefix: which of ttft, round-robin, single (one replica alone) to run")
    parser.add_argument("--router-args", default="", help="more podium router options (e.g. --log-level debug)")
    parser.add_argument("--num-prompts", type=int, default=None)
    parser.add_argument("--request-rate", default=None, help="requests/s (Poisson) or inf")
    parser.add_argument("--output-len", type=int, default=None)
    parser.add_argument("--input-len", type=int, default=512, help="mixed: prompt tokens")
    parser.add_argument("--rounds", type=int, default=2, help="overhead: direct/router rounds, order alternating")
    parser.add_argument("--paired", action="store_true",
                        help="overhead: each round runs both paths at once (half the requests and the rate each, "
                             "prompts of two seeds swapped between the paths every round), so the replica's drift "
                             "over the run reaches both alike; needs a finite --request-rate")
    parser.add_argument("--fast-args", default="--device cuda", help="mixed: the fast replica's extra options")
    parser.add_argument("--slow-args", default="--device cpu", help="mixed: the slow replica's extra options")
    parser.add_argument("--slow-env", default="", help="mixed: environment of the slow replica alone, e.g. "
                        "OMP_NUM_THREADS=12 (a CPU replica that leaves cores to the fast replica's host side)")
    parser.add_argument("--rates", default=None, help="mixed, prefix: request rates, comma-separated (mixed's "
                        "default 0.5,1,2,4,8,16; prefix's: --request-rate alone)")
    parser.add_argument("--one-group-at-a-time", action="store_true",
                        help="prefix: start each group's replicas when its turn comes (a device that holds "
                             "one group's replicas, not all seven at once)")
    parser.add_argument("--warmup", type=int, default=0,
                        help="prefix: untimed requests to each replica before its group's timed runs")
    parser.add_argument("--gpu-busy", action="store_true",
                        help="prefix: the device's busy share and peak memory during each run (nvidia-smi)")
    parser.add_argument("--time-limit", type=float, default=0,
                        help="prefix: seconds for the whole scenario; runs that would not finish are skipped")
    parser.add_argument("--small", action="store_true", help="a tiny workload: checks the script on a CPU")
    parser.add_argument("--log-dir", type=Path, default=None, help="keep the servers' logs here (default: dropped)")
    parser.add_argument("--summary", type=Path, default=Path(os.environ["OUT"]) / "summary.txt"
                        if os.environ.get("OUT") else None, help="append the tables here (default: $OUT/summary.txt)")
    args = parser.parse_args()
    # a time limit's SIGTERM unwinds the with-blocks: every replica and router started is stopped
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    unknown = set(args.groups.split(",")) - {"ttft", "round-robin", "single"}
    if unknown:
        parser.error(f"--groups takes ttft, round-robin and single; not {', '.join(sorted(unknown))}")
    sized = {"--num-kv-blocks", "--num-gpu-blocks-override"} & set(shlex.split(args.serve_args))
    if args.scenario == "prefix" and args.cache_prefixes and sized:
        parser.error(f"--serve-args give {sized.pop()} and --cache-prefixes {args.cache_prefixes:g} sizes the cache "
                     "too; give --cache-prefixes 0 to keep the --serve-args' size")
    defaults = {"prefix": (200, "4", 16), "overhead": (1000, "inf", None), "mixed": (200, None, 64)}[args.scenario]
    if args.scenario == "mixed":
        args.rates = args.rates or "0.5,1,2,4,8,16"
    args.num_prompts = args.num_prompts or defaults[0]
    args.request_rate = args.request_rate or defaults[1]
    if args.paired and float(args.request_rate) == float("inf"):
        parser.error("--paired splits a finite --request-rate between the two paths; give one")
    args.output_len = args.output_len or defaults[2] or 16
    with tempfile.TemporaryDirectory(prefix="router-bench-") as tmp:
        log_dir = args.log_dir or Path(tmp)
        log_dir.mkdir(parents=True, exist_ok=True)
        {"prefix": run_prefix, "overhead": run_overhead, "mixed": run_mixed}[args.scenario](args, log_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
