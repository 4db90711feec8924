"""What the router's relay costs, on a CPU: a fake replica that steps like an engine, the router in
front of it, and a Poisson client; direct and routed alternate.

    python benchmarks/router_relay.py                        # 40 requests/s, 400 a round, 2 rounds
    python benchmarks/router_relay.py --compare-src /tmp/base/router/src
        # another router alongside this tree's, alternated (git archive BASE router/src | tar -x -C /tmp/base)

The fake replica (this file with ``--fake-replica PORT``) answers a streamed chat completion with its
role chunk, 20 ms later its first token, then one chunk per decode step of 10 ms, every running
stream in the same step: the router sees a decode step as a burst of chunks, one per stream, and a
new request's first token waits behind whatever of the burst its event loop has not relayed yet.
Each round prints p50/p90 time to the first content chunk, direct and routed, and the router's CPU
time (user + system, from /proc) per chunk it relayed.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import httpx

THIS_TREE = str(Path(__file__).resolve().parents[1] / "router" / "src")
STEP_S, FIRST_TOKEN_S = 0.010, 0.020


# -- the fake replica --------------------------------------------------------------------------------
def fake_replica(port: int, tokens: int) -> None:
    import uvicorn
    from starlette.applications import Starlette
    from starlette.responses import JSONResponse, StreamingResponse
    from starlette.routing import Route

    step: asyncio.Future | None = None

    async def steps() -> None:
        nonlocal step
        while True:
            step = asyncio.get_running_loop().create_future()
            await asyncio.sleep(STEP_S)
            step.set_result(None)

    async def chat(request):
        await request.body()

        async def stream():
            yield b'data: {"choices":[{"index":0,"delta":{"role":"assistant"}}]}\n\n'
            await asyncio.sleep(FIRST_TOKEN_S)
            event = {"id": "x", "object": "chat.completion.chunk", "choices": [{"index": 0, "delta": {"content": "tok "}}]}
            for _ in range(tokens):
                await step
                yield f"data: {json.dumps(event)}\n\n".encode()
            yield b"data: [DONE]\n\n"

        return StreamingResponse(stream(), media_type="text/event-stream")

    async def health(request):
        return JSONResponse({"status": "ok"})

    @contextlib.asynccontextmanager
    async def lifespan(app):
        task = asyncio.ensure_future(steps())
        yield
        task.cancel()

    app = Starlette(routes=[Route("/v1/chat/completions", chat, methods=["POST"]), Route("/health", health)],
                    lifespan=lifespan)
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning")


# -- measuring ---------------------------------------------------------------------------------------
async def first_tokens(url: str, rate: float, requests: int) -> list[float]:
    """Seconds to each request's first content chunk, requests sent at ``rate``/s (Poisson, seeded)."""
    body = {"model": "m", "stream": True, "messages": [{"role": "user", "content": "hi " * 200}]}
    out: list[float] = []

    async def one(client: httpx.AsyncClient) -> None:
        start, first = time.perf_counter(), None
        async with client.stream("POST", url + "/v1/chat/completions", json=body) as response:
            async for line in response.aiter_lines():  # (read to the end: the stream stays in the steps)
                if first is None and '"content"' in line:
                    first = time.perf_counter() - start
        out.append(first)

    rng = random.Random(0)
    async with httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_connections=1000)) as client:
        tasks = []
        for _ in range(requests):
            tasks.append(asyncio.ensure_future(one(client)))
            await asyncio.sleep(rng.expovariate(rate))
        await asyncio.gather(*tasks)
    return sorted(out)


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def wait_healthy(url: str, proc: subprocess.Popen) -> None:
    for _ in range(300):
        if proc.poll() is not None:
            raise RuntimeError(f"{url} exited with {proc.returncode}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise RuntimeError(f"{url} did not become healthy")


def measure(name: str, src: str, replica_url: str, args) -> None:
    port = args.port + 1
    env = {**os.environ, "PYTHONPATH": src}
    router = subprocess.Popen([sys.executable, "-c", "import sys; from podium_router.cli import main; "
                               "sys.exit(main(sys.argv[1:]))", "router", "--replica", replica_url, "--port", str(port),
                               "--log-level", "warning"], env=env, stdout=subprocess.DEVNULL)
    try:
        router_url = f"http://127.0.0.1:{port}"
        wait_healthy(router_url, router)
        time.sleep(1.0)  # the replica passes its first checks
        direct = asyncio.run(first_tokens(replica_url, args.rate, args.requests))
        before = cpu_seconds(router.pid)
        routed = asyncio.run(first_tokens(router_url, args.rate, args.requests))
        cpu = cpu_seconds(router.pid) - before
    finally:
        router.terminate()
        router.wait()
    p = lambda ts, q: 1000 * ts[int(q * len(ts))]  # noqa: E731
    chunks = args.requests * (args.tokens + 2)  # the role chunk, the tokens, [DONE]
    print(f"{name:>8}: p50 TTFT direct {p(direct, .5):6.2f} ms, routed {p(routed, .5):6.2f} ms "
          f"(added {p(routed, .5) - p(direct, .5):+5.2f} ms); p90 {p(direct, .9):6.2f} / {p(routed, .9):6.2f} ms; "
          f"router CPU {1e6 * cpu / chunks:5.1f} us a chunk", flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rate", type=float, default=40.0, help="requests/s (Poisson)")
    parser.add_argument("--requests", type=int, default=400, help="requests per measurement")
    parser.add_argument("--tokens", type=int, default=150, help="content chunks per stream")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--port", type=int, default=18801, help="the fake replica's; the router takes the next")
    parser.add_argument("--compare-src", default=None, help="another router's source folder (holding podium_router)")
    parser.add_argument("--fake-replica", type=int, default=None, metavar="PORT", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.fake_replica is not None:
        fake_replica(args.fake_replica, args.tokens)
        return 0
    replica_url = f"http://127.0.0.1:{args.port}"
    replica = subprocess.Popen([sys.executable, __file__, "--fake-replica", str(args.port), "--tokens", str(args.tokens)])
    routers = [("this", THIS_TREE)] + ([("compare", args.compare_src)] if args.compare_src else [])
    try:
        wait_healthy(replica_url, replica)
        print(f"{args.rate:g} requests/s, {args.requests} a measurement, {args.tokens} tokens each "
              f"(~{args.rate * args.tokens * STEP_S:.0f}-stream decode steps)", flush=True)
        for round_ in range(args.rounds):
            for name, src in routers if round_ % 2 == 0 else routers[::-1]:
                measure(name, src, replica_url, args)
    finally:
        replica.terminate()
        replica.wait()
    return 0


if __name__ == "__main__":
    sys.exit(main())
