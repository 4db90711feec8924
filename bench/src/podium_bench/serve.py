"""``podium bench serve``: load an OpenAI-compatible server the way ``vllm bench serve`` does.

Requests arrive at ``request_rate`` per second (``inf``: all at once) with gamma-distributed gaps
of shape ``burstiness`` (vLLM's definition: 1 is a Poisson process, below 1 burstier, above 1 more
even; the mean rate is the same), at most ``max_concurrency`` in flight; each one streams, and the client timestamps every chunk. One
short test request runs first (untimed) so a wrong URL or model fails at once. Only an HTTP
client is needed: the server can be Podium, vLLM, llama.cpp's server or anything that speaks
the OpenAI API.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from .datasets import BenchRequest
from .metrics import RequestTiming, serve_metrics
from .report import format_rows
from .serve_client import PayloadOptions, api_url, build_payload, prompt_of, send_streaming

TEST_PROMPT_TOKENS = 8  # below one KV block: the test request leaves no prefix-cache entry behind


@dataclass(frozen=True)
class ServeOptions:
    base_url: str = "http://127.0.0.1:8000"
    payload: PayloadOptions = PayloadOptions()
    request_rate: float = math.inf
    burstiness: float = 1.0
    max_concurrency: int | None = None
    seed: int = 0
    timeout_s: float = 6 * 3600.0
    api_key: str | None = None
    percentiles: tuple[float, ...] = (99,)
    goodput: dict[str, float] | None = None  # SLOs in ms: {"ttft": 500, "tpot": 50, "e2el": ...} (metrics.goodput)
    progress: bool = True

    def __post_init__(self) -> None:
        if not self.request_rate > 0:
            raise ValueError(f"--request-rate must be > 0 (or inf), got {self.request_rate}")
        if not self.burstiness > 0:
            raise ValueError(f"--burstiness must be > 0, got {self.burstiness}")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError(f"--max-concurrency must be >= 1, got {self.max_concurrency}")
        if any(not 0 < p <= 100 for p in self.percentiles):
            raise ValueError(f"--percentiles must be in (0, 100], got {list(self.percentiles)}")


def arrival_delays(num: int, rate: float, seed: int, burstiness: float = 1.0) -> list[float]:
    """Seconds to wait before each request, 0 for ``inf``: gamma-distributed gaps of shape
    ``burstiness`` and mean ``1 / rate`` (scale ``1 / (rate * burstiness)``; shape 1: exponential
    gaps, a Poisson process). Their coefficient of variation is ``1 / sqrt(burstiness)``."""
    if math.isinf(rate):
        return [0.0] * num
    rng = np.random.default_rng(seed)
    return [float(x) for x in rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=num)]


async def _arrivals(requests: list[BenchRequest], delays: list[float]) -> AsyncIterator[tuple[int, BenchRequest]]:
    for index, (request, delay) in enumerate(zip(requests, delays)):
        if delay > 0:
            await asyncio.sleep(delay)
        yield index, request


async def discover_model(client, base_url: str, headers: dict | None) -> tuple[str, str | None]:
    """The first model the server lists at ``/v1/models``: its id and its ``root`` (vLLM and Podium:
    the model argument the server was started with, a local path or name), if it says."""
    url = api_url(base_url, "completions").rsplit("/", 1)[0] + "/models"
    response = await client.get(url, headers=headers)
    if response.status_code != 200:
        raise RuntimeError(f"GET {url} returned HTTP {response.status_code}; pass --model")
    models = response.json().get("data") or []
    if not models:
        raise RuntimeError(f"{url} lists no models; pass --model")
    return models[0]["id"], models[0].get("root")


async def served_model(options: ServeOptions, transport: Any = None) -> tuple[ServeOptions, list[str]]:
    """``options`` with the model to send (``--model``, else the server's first), and the names a
    tokenizer may be found under here, best first (the server's ``root``, then the model id)."""
    if options.payload.model:
        return options, [options.payload.model]
    import httpx

    headers = {"Authorization": f"Bearer {options.api_key}"} if options.api_key else None
    async with httpx.AsyncClient(timeout=httpx.Timeout(60.0), transport=transport) as client:
        model, root = await discover_model(client, options.base_url, headers)
    return replace(options, payload=replace(options.payload, model=model)), list(dict.fromkeys(filter(None, (root, model))))


async def _test_request(client, url: str, request: BenchRequest, tokenizer: Any, options: PayloadOptions,
                        headers: dict | None) -> None:
    text = request.prompt[: 2 * TEST_PROMPT_TOKENS] if request.prompt is not None and tokenizer is None else None
    short = BenchRequest(request.prompt_token_ids[:TEST_PROMPT_TOKENS], 2, text)
    timing = await send_streaming(client, url, build_payload(short, prompt_of(short, tokenizer, options.endpoint),
                                                             options, 2), short.input_len, headers)
    if not timing.success:
        raise RuntimeError(f"the test request to {url} failed ({timing.error}); check --base-url, --model, --endpoint")


async def run_requests(options: ServeOptions, requests: list[BenchRequest], tokenizer: Any = None,
                       transport: Any = None) -> tuple[list[RequestTiming], float, str]:
    """Send every request; returns their timings (in request order), the duration and the model."""
    try:
        import httpx
    except ImportError:
        raise RuntimeError("podium bench serve needs httpx: pip install httpx") from None
    from tqdm.auto import tqdm

    headers = {"Authorization": f"Bearer {options.api_key}"} if options.api_key else None
    # idle connections dropped after 2 s, before a server with a 5 s keep-alive (uvicorn's default) closes
    # them: a reused connection the server had just closed failed its request with a ReadError
    limits = httpx.Limits(max_connections=options.max_concurrency, max_keepalive_connections=options.max_concurrency,
                          keepalive_expiry=2.0)
    async with httpx.AsyncClient(timeout=httpx.Timeout(options.timeout_s), limits=limits, transport=transport) as client:
        payload_opts = options.payload
        if not payload_opts.model:
            payload_opts = replace(payload_opts, model=(await discover_model(client, options.base_url, headers))[0])
        url = api_url(options.base_url, payload_opts.endpoint)
        bodies = [build_payload(r, prompt_of(r, tokenizer, payload_opts.endpoint), payload_opts) for r in requests]
        await _test_request(client, url, requests[0], tokenizer, payload_opts, headers)
        gate = asyncio.Semaphore(options.max_concurrency) if options.max_concurrency else None
        bar = tqdm(total=len(requests), desc="requests", unit="req", disable=not options.progress)

        async def one(index: int, request: BenchRequest) -> RequestTiming:
            if gate is None:
                timing = await send_streaming(client, url, bodies[index], request.input_len, headers)
            else:
                async with gate:
                    timing = await send_streaming(client, url, bodies[index], request.input_len, headers)
            bar.update(1)
            return timing

        start = time.perf_counter()
        tasks = [asyncio.create_task(one(i, r))
                 async for i, r in _arrivals(requests, arrival_delays(len(requests), options.request_rate, options.seed,
                                                                     options.burstiness))]
        timings = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
        bar.close()
    return list(timings), duration, payload_opts.model


def summarize_serve(options: ServeOptions, timings: list[RequestTiming], duration: float, model: str) -> dict:
    result = serve_metrics(timings, duration, options.percentiles, options.goodput)
    errors = [t.error for t in timings if not t.success]
    return {
        "config": {
            "base_url": options.base_url,
            "endpoint": options.payload.endpoint,
            "model": model,
            "request_rate": "inf" if math.isinf(options.request_rate) else options.request_rate,
            "burstiness": options.burstiness,
            "max_concurrency": options.max_concurrency,
            "goodput_slo_ms": options.goodput,
            "ignore_eos": options.payload.ignore_eos,
        },
        "results": result,
        "errors": errors[:20],
        "per_request": {
            "ttft_s": [t.ttft for t in timings],
            "e2el_s": [t.e2el for t in timings],
            "input_tokens": [t.input_tokens for t in timings],
            "output_tokens": [t.output_tokens for t in timings],
        },
    }


def format_serve(summary: dict, percentiles=(99,)) -> str:
    r = summary["results"]
    rows: list[tuple[str, object]] = [
        ("Successful requests", r["completed"]),
        ("Failed requests", r["failed"]),
        ("Request rate configured (RPS)", summary["config"]["request_rate"]),
        ("Max concurrency", summary["config"]["max_concurrency"]),
        ("Benchmark duration (s)", r["duration_s"]),
        ("Total input tokens", r["total_input_tokens"]),
        ("Total generated tokens", r["total_output_tokens"]),
        ("Request throughput (req/s)", r["request_throughput"]),
        *([("Request goodput (req/s)", r["request_goodput"])] if "request_goodput" in r else []),
        ("Output token throughput (tok/s)", r["output_throughput"]),
        ("Total token throughput (tok/s)", r["total_token_throughput"]),
    ]
    titles = {"ttft": "Time to First Token", "tpot": "Time per Output Token (excl. 1st token)",
              "itl": "Inter-token Latency", "e2el": "End-to-end Latency"}
    for key, title in titles.items():
        rows.append((f"--- {title}", ""))
        rows.append((f"Mean {key.upper()} (ms)", r[f"mean_{key}_ms"]))
        rows.append((f"Median {key.upper()} (ms)", r[f"median_{key}_ms"]))
        for p in percentiles:
            rows.append((f"P{p:g} {key.upper()} (ms)", r[f"p{p:g}_{key}_ms"]))
    text = format_rows("Serving Benchmark Result", rows)
    if summary["errors"]:
        text += "\nfirst error: " + summary["errors"][0]
    return text
