"""Server at saturation against the offline ``LLM``, in both engine modes: same prompts, machine and run.

    .venv/bin/python server/benchmarks/saturation.py [--num-prompts 32] [--output-len 64] [--rounds 3]
                                                      [--modes process,thread] [--model smollm2-135m-instruct]

- offline: ``LLM.generate`` on every prompt at once (greedy, ``ignore_eos``, exactly
  ``--output-len`` tokens each), each round on a fresh thread, as a server steps its engine on a
  thread other than the one that loaded it (on a crowded CPU, torch ran ~10x slower on the
  loading thread, its OpenMP team spin-waiting for cores, which would flatter the server);
- one ``podium serve --engine-mode MODE`` subprocess per mode, all started up front (an idle
  server takes no CPU); every prompt sent at once as a streaming completion while ``/health`` is
  probed every 100 ms: its latency shows how long the event loop is kept from answering.

The load generator is as cheap as a Python client gets (raw asyncio sockets, one read per
network chunk, only the final usage event parsed): it shares the machine's cores with the
server, and what it spends is not the server's cost. It still counts in "tok/s"; "tok/CPU-s"
divides by the server's own CPU time (all its processes and threads) and so leaves the client
and other tenants of a shared machine out.

Everything warms up first (4 tokens per prompt); then each round runs offline, then every mode,
one at a time. The best round of each counts (a noisy machine slows runs, never speeds them up);
medians are shown too. The target: the server keeps >= 90% of offline tok/s.

Run it on a quiet machine. On a loaded one "tok/s" also measures how the kernel shares the cores
(a server's several processes and threads can get a larger share than the offline run's two),
so read "tok/CPU-s" there. Every side inherits the environment, OMP_WAIT_POLICY included (printed
in the header; ``make test`` uses PASSIVE).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import pathlib
import re
import socket
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

_USAGE = re.compile(rb'"completion_tokens":(\d+)')


def prompts(n: int) -> list[str]:
    return [f"Request {i}: write a short story about a robot who learns the number {i * 13 + 5}." for i in range(n)]


# -- offline -----------------------------------------------------------------------------------
def offline_run(llm, texts: list[str], output_len: int) -> dict:
    from podium import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    start, cpu = time.perf_counter(), time.process_time()
    outs = llm.generate(texts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    return {"tps": tokens / elapsed, "tokens": tokens, "cpu": (time.process_time() - cpu) / elapsed}


def _in_fresh_thread(fn, *args):
    with ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(fn, *args).result()


# -- the load generator ------------------------------------------------------------------------
async def _stream(port: int, body: bytes) -> int:
    """One streaming completion over a raw socket; returns the completion tokens its usage reports."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: bench\r\nContent-Type: application/json\r\n"
                 b"Connection: close\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
    head, tail = b"", b""
    while chunk := await reader.read(1 << 16):
        head = head or chunk[:16]
        tail = (tail + chunk)[-2048:]
    writer.close()
    if not head.startswith(b"HTTP/1.1 200"):
        raise RuntimeError(f"the server answered {head!r}: {tail[-500:]!r}")
    found = _USAGE.findall(tail)
    return int(found[-1]) if found else 0


async def _probe(port: int, stop: asyncio.Event, latencies: list[float]) -> None:
    """``GET /health`` every 100 ms on one kept-alive connection (a new connection per probe cost the
    server ~0.8 ms of CPU each, which is not what is measured here)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    while not stop.is_set():
        start = time.perf_counter()
        writer.write(b"GET /health HTTP/1.1\r\nHost: bench\r\n\r\n")
        head = await reader.readuntil(b"\r\n\r\n")
        length = re.search(rb"(?i)content-length: *(\d+)", head)
        await reader.readexactly(int(length.group(1)) if length else 0)
        latencies.append(time.perf_counter() - start)
        await asyncio.sleep(0.1)
    writer.close()


def _cpu_seconds(path: str) -> float:
    fields = pathlib.Path(path).read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _tree(pid: int) -> list[int]:
    """``pid`` and its descendants."""
    pids, i = [pid], 0
    while i < len(pids):
        for task in pathlib.Path(f"/proc/{pids[i]}/task").iterdir():
            pids.extend(int(p) for p in (task / "children").read_text().split())
        i += 1
    return pids


def _server_cpu(pid: int) -> tuple[float, float]:
    """CPU seconds of the server's event-loop thread, and of all its processes together."""
    return _cpu_seconds(f"/proc/{pid}/task/{pid}/stat"), sum(_cpu_seconds(f"/proc/{p}/stat") for p in _tree(pid))


async def saturate(port: int, pid: int, model: str, texts: list[str], output_len: int) -> dict:
    """Every prompt at once; tok/s, CPU seconds per second (event loop, whole server, client), probes."""
    bodies = [json.dumps({"model": model, "prompt": p, "max_tokens": output_len, "temperature": 0,
                          "ignore_eos": True, "stream": True,
                          "stream_options": {"include_usage": True}}).encode() for p in texts]
    stop, latencies = asyncio.Event(), []
    probe = asyncio.create_task(_probe(port, stop, latencies))
    cpu0, client0 = _server_cpu(pid), time.process_time()
    start = time.perf_counter()
    counts = await asyncio.gather(*(_stream(port, b) for b in bodies))
    elapsed = time.perf_counter() - start
    cpu1, client1 = _server_cpu(pid), time.process_time()
    stop.set()
    await probe
    return {"tps": sum(counts) / elapsed, "tokens": sum(counts), "loop_cpu": (cpu1[0] - cpu0[0]) / elapsed,
            "cpu": (cpu1[1] - cpu0[1]) / elapsed, "client_cpu": (client1 - client0) / elapsed,
            "latencies": latencies}


# -- servers -----------------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(model: str, mode: str) -> tuple[subprocess.Popen, int]:
    port = _free_port()
    podium = pathlib.Path(sys.executable).parent / "podium"
    proc = subprocess.Popen([str(podium), "serve", model, "--port", str(port), "--log-level", "warning",
                             "--engine-mode", mode], env={**os.environ, "PODIUM_API_KEY": ""})
    return proc, port


def wait_healthy(proc: subprocess.Popen, port: int) -> None:
    while True:
        if proc.poll() is not None:
            raise SystemExit(f"podium serve exited with {proc.returncode}")
        with contextlib.suppress(OSError):
            with socket.create_connection(("127.0.0.1", port), timeout=2) as s:
                s.sendall(b"GET /health HTTP/1.1\r\nHost: bench\r\nConnection: close\r\n\r\n")
                if s.recv(64).startswith(b"HTTP/1.1 200"):
                    return
        time.sleep(0.5)


# -- report ------------------------------------------------------------------------------------
def table(runs: dict[str, list[dict]]) -> str:
    offline = runs["offline"]
    best_offline = max(r["tps"] for r in offline)
    per_cpu_offline = statistics.median(r["tps"] / r["cpu"] for r in offline)
    lines = [f"{'':8} {'best tok/s':>10} {'median':>8} {'vs offline':>10} {'tok/CPU-s':>9} {'vs offline':>10} "
             f"{'CPU s/s':>7} {'loop':>5} {'client':>6} {'/health p50':>11} {'p99':>7}"]
    for name, rs in runs.items():
        best = max(r["tps"] for r in rs)
        per_cpu = statistics.median(r["tps"] / r["cpu"] for r in rs)
        row = (f"{name:8} {best:10.1f} {statistics.median(r['tps'] for r in rs):8.1f} {best / best_offline:10.1%} "
               f"{per_cpu:9.0f} {per_cpu / per_cpu_offline:10.1%} {statistics.median(r['cpu'] for r in rs):7.2f}")
        if name != "offline":
            lat = [x for r in rs for x in r["latencies"]]
            q = statistics.quantiles(lat, n=100) if len(lat) > 1 else [lat[0] if lat else 0.0] * 99
            row += (f" {statistics.median(r['loop_cpu'] for r in rs):5.2f} "
                    f"{statistics.median(r['client_cpu'] for r in rs):6.2f} {q[49] * 1e3:8.1f} ms {q[98] * 1e3:4.0f} ms")
        lines.append(row)
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3, help="run offline and every mode this many times")
    parser.add_argument("--modes", default="process,thread", help="engine modes to serve, comma-separated")
    args = parser.parse_args()
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    texts = prompts(args.num_prompts)
    print(f"saturation: {args.num_prompts} prompts x {args.output_len} tokens, {args.rounds} rounds, "
          f"model {args.model}, {os.cpu_count()} CPUs, OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY', 'unset')}",
          flush=True)
    servers = {mode: start_server(args.model, mode) for mode in modes}
    try:
        from podium import LLM

        llm = LLM(args.model)
        for proc, port in servers.values():
            wait_healthy(proc, port)
        _in_fresh_thread(offline_run, llm, texts, 4)
        for proc, port in servers.values():
            asyncio.run(saturate(port, proc.pid, args.model, texts, 4))
        runs: dict[str, list[dict]] = {"offline": [], **{mode: [] for mode in modes}}
        for i in range(args.rounds):
            runs["offline"].append(_in_fresh_thread(offline_run, llm, texts, args.output_len))
            for mode, (proc, port) in servers.items():
                runs[mode].append(asyncio.run(saturate(port, proc.pid, args.model, texts, args.output_len)))
            print(f"round {i + 1}: " + ", ".join(f"{name} {rs[-1]['tps']:.1f} tok/s (CPU {rs[-1]['cpu']:.2f} s/s)"
                                                 for name, rs in runs.items()), flush=True)
        expected = args.num_prompts * args.output_len
        short = [name for name, rs in runs.items() if any(r["tokens"] != expected for r in rs)]
        if short:
            print(f"warning: {', '.join(short)} did not produce {expected} tokens every round")
        print(table(runs))
    finally:
        for proc, _ in servers.values():
            proc.terminate()
        for proc, _ in servers.values():
            proc.wait(timeout=120)


if __name__ == "__main__":
    main()
