"""Soak: a long mixed load against ``podium serve``; does the server stay correct, fast and flat?

    python benchmarks/soak.py --duration 180 --out soak.json              # starts podium serve (SmolLM2)
    python benchmarks/soak.py --url http://127.0.0.1:8000 --duration 1800  # against a running server

Mixed load from ``--concurrency`` clients: streamed chat and completions, streams the client
drops after a few chunks (disconnects), n=2 samples, logprobs, and ``--bad-fraction`` (5%) of
hostile requests (top_k beyond int64, JSON nested 10,000 deep, unknown fields, negative
max_tokens, broken JSON, a prompt past the context). Reported (JSON, and a summary on stdout):
requests answered, outcomes by class (a bad request must get a 4xx; anything else is a failure),
per window the requests answered, the failures by class, p50/p99 latency and the RSS of the server
process and of the engine process (process mode; with ``--engine-mode thread`` the engine is the
server's), RSS growth per process (first window to last, and after the first quarter), and at the
end, after the load: the KV blocks free (from /metrics) and /health. Exit status 1 on any failure
or a KV block not free at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import httpx

WORDS = "alpha beta gamma delta river mountain code python music light ocean tree stone cloud".split()
BAD_REQUESTS = {
    "top_k_overflow": lambda: ("/v1/completions", {"prompt": "hi", "top_k": 2**63, "temperature": 0.7}),
    "deep_json": lambda: ("/v1/chat/completions", '{"messages": ' + "[" * 10_000 + "]" * 10_000 + "}"),
    "unknown_field": lambda: ("/v1/completions", {"prompt": "hi", "no_such_field": 1}),
    "negative_max_tokens": lambda: ("/v1/completions", {"prompt": "hi", "max_tokens": -5}),
    "broken_json": lambda: ("/v1/completions", '{"prompt": "hi", '),
    "too_long": lambda: ("/v1/completions", {"prompt": "word " * 20_000, "max_tokens": 4}),
}


def _prompt(rng: random.Random) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 40)))


# -- one request of each kind: returns (outcome class, latency seconds) ----------------------------------
async def _sse(client: httpx.AsyncClient, path: str, body: dict, drop_after: int | None) -> str:
    chunks = 0
    async with client.stream("POST", path, json=body) as response:
        if response.status_code != 200:
            await response.aread()
            return f"http_{response.status_code}"
        async for line in response.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                return "ok"
            if '"error"' in line[:20]:
                return "stream_error_event"
            chunks += 1
            if drop_after is not None and chunks >= drop_after:
                return "disconnected"  # leaving the block closes the connection mid-stream
    return "stream_cut"  # ended without [DONE]


async def _one(client: httpx.AsyncClient, rng: random.Random, bad_fraction: float, max_tokens: int) -> tuple[str, str]:
    if rng.random() < bad_fraction:
        name = rng.choice(sorted(BAD_REQUESTS))
        path, body = BAD_REQUESTS[name]()
        kwargs = {"content": body, "headers": {"content-type": "application/json"}} if isinstance(body, str) \
            else {"json": body}
        response = await client.post(path, **kwargs)
        return f"bad:{name}", "rejected_4xx" if 400 <= response.status_code < 500 else f"bad_got_{response.status_code}"
    kind = rng.choice(["chat_stream", "completion_stream", "disconnect", "n2", "logprobs"])
    tokens = rng.randint(4, max_tokens)
    common = {"max_tokens": tokens, "temperature": rng.choice([0, 0.8]), "seed": rng.randint(0, 999)}
    if kind == "chat_stream":
        body = {"messages": [{"role": "user", "content": _prompt(rng)}], "stream": True, **common}
        return kind, await _sse(client, "/v1/chat/completions", body, None)
    if kind in ("completion_stream", "disconnect"):
        body = {"prompt": _prompt(rng), "stream": True, **common}
        return kind, await _sse(client, "/v1/completions", body, rng.randint(1, 3) if kind == "disconnect" else None)
    if kind == "n2":
        response = await client.post("/v1/completions", json={"prompt": _prompt(rng), "n": 2, **common})
        ok = response.status_code == 200 and len(response.json()["choices"]) == 2
        return kind, "ok" if ok else f"http_{response.status_code}"
    response = await client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": _prompt(rng)}],
                                                                "logprobs": True, "top_logprobs": 3, **common})
    ok = response.status_code == 200 and response.json()["choices"][0]["logprobs"] is not None
    return kind, "ok" if ok else f"http_{response.status_code}"


# -- the server's memory ----------------------------------------------------------------------------------
def _rss_bytes(pid: int) -> dict[str, int]:
    """RSS by role, from /proc: ``server`` (``pid``), ``engine`` (its descendants: the engine process
    in process mode, tensor-parallel workers) and ``helpers`` (multiprocessing's resource tracker)."""
    sizes: dict[str, int] = {}
    todo = [(pid, "server")]
    while todo:
        p, role = todo.pop()
        try:
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    sizes[role] = sizes.get(role, 0) + int(line.split()[1]) * 1024
            for task in Path(f"/proc/{p}/task").iterdir():
                todo += [(int(c), _role(int(c))) for c in (task / "children").read_text().split()]
        except (OSError, ValueError):
            continue
    return sizes


def _role(pid: int) -> str:
    try:
        command = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return "engine"
    return "helpers" if b"resource_tracker" in command else "engine"


def _listening_pid(port: int) -> int | None:
    """The pid of the process listening on ``port`` (for --url on this machine), from /proc."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            for line in Path(table).read_text().splitlines()[1:]:
                fields = line.split()
                if fields[3] == "0A" and int(fields[1].rsplit(":", 1)[1], 16) == port:
                    inodes.add(fields[9])
        except OSError:
            pass
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            for fd in (proc / "fd").iterdir():
                if os.readlink(fd).removeprefix("socket:[").rstrip("]") in inodes:
                    return int(proc.name)
        except OSError:
            continue
    return None


# -- the run ----------------------------------------------------------------------------------------------
async def soak(url: str, pid: int | None, args: argparse.Namespace) -> dict:
    rng = random.Random(args.seed)
    records: list[tuple[float, float, str, str]] = []  # (end time, latency, kind, outcome)
    started = time.monotonic()
    stop_at = started + args.duration
    limits = httpx.Limits(max_connections=args.concurrency * 2)

    async with httpx.AsyncClient(base_url=url, timeout=args.request_timeout, limits=limits) as client:
        async def worker(seed: int) -> None:
            local = random.Random(seed)
            while time.monotonic() < stop_at:
                t0 = time.monotonic()
                try:
                    kind, outcome = await _one(client, local, args.bad_fraction, args.max_tokens)
                except httpx.HTTPError as exc:
                    kind, outcome = "transport", f"transport_{type(exc).__name__}"
                records.append((time.monotonic(), time.monotonic() - t0, kind, outcome))

        async def sampler(series: list) -> None:
            while time.monotonic() < stop_at:
                await asyncio.sleep(args.window)
                series.append((round(time.monotonic() - started, 1), _rss_bytes(pid) if pid else {}))

        rss_series: list = []
        await asyncio.gather(*(worker(rng.randrange(2**31)) for _ in range(args.concurrency)), sampler(rss_series))
        await asyncio.sleep(2.0)  # aborted streams release their blocks
        metrics = (await client.get("/metrics")).text
        health = (await client.get("/health")).status_code
    return _report(records, rss_series, metrics, health, started, args)


def _metric(text: str, name: str) -> float | None:
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    return None


def _report(records, rss_series, metrics: str, health: int, started: float, args) -> dict:
    outcomes = Counter(f"{kind}={outcome}" for _, _, kind, outcome in records)
    windows = []
    for i, (at, sizes) in enumerate(rss_series):
        lo = rss_series[i - 1][0] if i else 0.0
        mine = [r for r in records if lo < r[0] - started <= at]
        latencies = sorted(lat for _, lat, _, outcome in mine if outcome == "ok")
        windows.append({"t_s": at, "answered": len(mine),
                        "errors": dict(Counter(f"{k}={o}" for _, _, k, o in mine if not _expected(f"{k}={o}"))),
                        "p50_s": round(statistics.median(latencies), 3) if latencies else None,
                        "p99_s": round(latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))], 3)
                        if latencies else None,
                        "rss_mib": {role: round(b / 2**20, 1) for role, b in sorted(sizes.items())}})
    free, total = _metric(metrics, "podium:num_free_kv_blocks"), _metric(metrics, "podium:num_kv_blocks")
    return {
        "duration_s": args.duration, "concurrency": args.concurrency, "bad_fraction": args.bad_fraction,
        "requests_answered": len(records), "outcomes": dict(sorted(outcomes.items())),
        "failures": {k: v for k, v in outcomes.items() if not _expected(k)},
        "kv_blocks_free_at_end": free, "kv_blocks_total": total, "health_at_end": health,
        **_rss_growth(windows), "windows": windows,
    }


def _expected(outcome: str) -> bool:
    """An answer the soak wants: a completed request, a hostile one refused with a 4xx, a client's own drop."""
    return outcome.endswith(("=ok", "=rejected_4xx", "=disconnected"))


def _rss_growth(windows: list[dict]) -> dict:
    """Per role: MiB from the first window to the last, and after the first quarter of the run (the
    allocator and the kernels' caches settle under the first requests; growth after that is a leak);
    with the mean of the second half over the first half's (1.0 = flat)."""
    growth, after_warmup, ratio = {}, {}, {}
    roles = sorted({role for w in windows for role in w["rss_mib"]})
    for role in roles:
        rss = [w["rss_mib"][role] for w in windows if role in w["rss_mib"]]
        if len(rss) < 2:
            continue
        half, quarter = len(rss) // 2, len(rss) // 4
        growth[role] = round(rss[-1] - rss[0], 1)
        after_warmup[role] = round(rss[-1] - rss[quarter], 1)
        ratio[role] = round(statistics.mean(rss[half:]) / statistics.mean(rss[:half]), 3)
    return {"rss_growth_mib": growth, "rss_growth_after_warmup_mib": after_warmup, "rss_growth_ratio": ratio}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start_server(args: argparse.Namespace) -> tuple[subprocess.Popen, str]:
    port = _free_port()
    podium = Path(sys.executable).parent / "podium"
    command = [str(podium), "serve", *([args.model] if args.model else []), "--port", str(port),
               "--log-level", "warning", *args.serve_arg]
    proc = subprocess.Popen(command, env={**os.environ, "PODIUM_API_KEY": ""})
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 600
    while time.time() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"podium serve exited with {proc.returncode}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise SystemExit("podium serve did not start within 600 s")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", help="a running server (default: start podium serve here)")
    parser.add_argument("--model", default=None, help="the model podium serve loads (default: its default)")
    parser.add_argument("--serve-arg", action="append", default=[], help="an extra podium serve argument (repeat)")
    parser.add_argument("--duration", type=float, default=180.0, help="seconds of load (default: 180)")
    parser.add_argument("--concurrency", type=int, default=8, help="clients at once (default: 8)")
    parser.add_argument("--bad-fraction", type=float, default=0.05, help="hostile requests (default: 0.05)")
    parser.add_argument("--max-tokens", type=int, default=32, help="largest max_tokens drawn (default: 32)")
    parser.add_argument("--window", type=float, default=15.0, help="seconds per reported window (default: 15)")
    parser.add_argument("--request-timeout", type=float, default=120.0, help="seconds (default: 120)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, help="write the JSON report here too")
    args = parser.parse_args()
    proc = None
    if args.url:
        url, pid = args.url.rstrip("/"), _listening_pid(httpx.URL(args.url).port or 80)
    else:
        proc, url = _start_server(args)
        pid = proc.pid
    try:
        report = asyncio.run(soak(url, pid, args))
    finally:
        if proc is not None:
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=120)
    text = json.dumps(report, indent=1)
    if args.out:
        args.out.write_text(text)
    print(text)
    print(f"soak: {report['requests_answered']} requests in {args.duration:g} s, failures {report['failures'] or 0}, "
          f"KV blocks free at end {report['kv_blocks_free_at_end']:g}/{report['kv_blocks_total']:g}, "
          f"RSS growth (MiB, first window to last) {report['rss_growth_mib']}, after the first quarter "
          f"{report['rss_growth_after_warmup_mib']}, /health {report['health_at_end']}", file=sys.stderr)
    return 0 if not report["failures"] and report["kv_blocks_free_at_end"] == report["kv_blocks_total"] else 1


if __name__ == "__main__":
    sys.exit(main())
