"""Benchmark arithmetic, as pure functions of timestamps and token counts.

Definitions (those of vLLM's ``vllm bench``, so results compare across engines):

- TTFT: first token-carrying chunk's arrival - request start.
- E2E latency: end of the stream - request start.
- TPOT (time per output token, the first excluded): (E2E - TTFT) / (output tokens - 1); only for
  requests with more than one output token.
- ITL (inter-token latency): every gap between consecutive token-carrying chunks, pooled over all
  requests (a chunk with several tokens is one gap, as a client sees it).
- Throughput: successful requests, output tokens, and input + output tokens per second of the
  benchmark's wall-clock duration. Failed requests count in no throughput or latency.
- Goodput (with service-level objectives in ms for any of ttft, tpot, e2el): the successful
  requests that meet every objective given, per second (a request with one output token has a
  TPOT of 0).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

LATENCY_METRICS = ("ttft", "tpot", "itl", "e2el")
GOODPUT_METRICS = ("ttft", "tpot", "e2el")


@dataclass
class RequestTiming:
    """One streamed request as the client saw it (``time.perf_counter()`` seconds)."""

    success: bool
    start: float
    end: float
    chunk_times: list[float] = field(default_factory=list)  # arrival of each token-carrying chunk
    input_tokens: int = 0
    output_tokens: int = 0
    error: str = ""

    @property
    def ttft(self) -> float | None:
        return self.chunk_times[0] - self.start if self.chunk_times else None

    @property
    def e2el(self) -> float:
        return self.end - self.start

    @property
    def tpot(self) -> float | None:
        if self.ttft is None or self.output_tokens < 2:
            return None
        return (self.e2el - self.ttft) / (self.output_tokens - 1)

    @property
    def itls(self) -> list[float]:
        return [b - a for a, b in zip(self.chunk_times, self.chunk_times[1:])]


def distribution_ms(values_s: list[float], percentiles=(99,)) -> dict[str, float]:
    """Mean, median, std and the given percentiles of ``values_s`` (seconds), in milliseconds.

    Percentiles interpolate linearly between samples (numpy's default). An empty list gives zeros.
    """
    values = np.asarray(values_s, dtype=np.float64) * 1000.0
    if values.size == 0:
        out = {"mean": 0.0, "median": 0.0, "std": 0.0}
        out.update({f"p{p:g}": 0.0 for p in percentiles})
        return out
    out = {"mean": float(values.mean()), "median": float(np.median(values)), "std": float(values.std())}
    out.update({f"p{p:g}": float(np.percentile(values, p)) for p in percentiles})
    return out


def meets_slos(timing: RequestTiming, slos_ms: dict[str, float]) -> bool:
    """Whether a successful request meets every objective in ``slos_ms`` (metric -> ms)."""
    values = {"ttft": timing.ttft, "tpot": timing.tpot or 0.0, "e2el": timing.e2el}
    return all(values[name] is not None and values[name] * 1000.0 <= slo for name, slo in slos_ms.items())


def parse_goodput(items: list[str] | None) -> dict[str, float] | None:
    """``["ttft:500", "tpot:50"]`` (vLLM's ``--goodput``) -> ``{"ttft": 500.0, "tpot": 50.0}``."""
    if not items:
        return None
    slos: dict[str, float] = {}
    for item in items:
        name, _, value = item.partition(":")
        if name not in GOODPUT_METRICS or not value:
            raise ValueError(f"--goodput takes KEY:MILLISECONDS with KEY one of {', '.join(GOODPUT_METRICS)}; "
                             f"got {item!r}")
        try:
            slos[name] = float(value)
        except ValueError:
            raise ValueError(f"--goodput {item!r}: {value!r} is not a number of milliseconds") from None
        if slos[name] < 0:
            raise ValueError(f"--goodput {item!r}: an objective must be >= 0 ms")
    return slos


def serve_metrics(timings: list[RequestTiming], duration_s: float, percentiles=(99,),
                  goodput: dict[str, float] | None = None) -> dict:
    """vLLM ``bench serve``'s summary of a run that took ``duration_s`` seconds of wall clock;
    with ``goodput`` (SLOs in ms), ``request_goodput`` too."""
    if duration_s <= 0:
        raise ValueError(f"duration_s must be > 0, got {duration_s}")
    ok = [t for t in timings if t.success]
    input_tokens = sum(t.input_tokens for t in ok)
    output_tokens = sum(t.output_tokens for t in ok)
    result = {
        "completed": len(ok),
        "failed": len(timings) - len(ok),
        "duration_s": duration_s,
        "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens,
        "request_throughput": len(ok) / duration_s,
        "output_throughput": output_tokens / duration_s,
        "total_token_throughput": (input_tokens + output_tokens) / duration_s,
    }
    if goodput:
        result["request_goodput"] = sum(meets_slos(t, goodput) for t in ok) / duration_s
    samples = {
        "ttft": [t.ttft for t in ok if t.ttft is not None],
        "tpot": [t.tpot for t in ok if t.tpot is not None],
        "itl": [gap for t in ok for gap in t.itls],
        "e2el": [t.e2el for t in ok],
    }
    for name in LATENCY_METRICS:
        for stat, value in distribution_ms(samples[name], percentiles).items():
            result[f"{stat}_{name}_ms"] = value
    return result


@dataclass(frozen=True)
class ThroughputResult:
    """An offline run: ``num_requests`` requests, their token counts, and the wall-clock time."""

    backend: str
    elapsed_s: float
    num_requests: int
    input_tokens: int
    output_tokens: int
    generated_tokens: int | None = None  # tokens actually produced, where a backend overshoots (hf)
    details: dict = field(default_factory=dict)  # backend-specific extras (prefix-cache hits, ...)

    def __post_init__(self) -> None:
        if self.elapsed_s <= 0:
            raise ValueError(f"elapsed_s must be > 0, got {self.elapsed_s}")

    @property
    def requests_per_s(self) -> float:
        return self.num_requests / self.elapsed_s

    @property
    def total_tokens_per_s(self) -> float:
        return (self.input_tokens + self.output_tokens) / self.elapsed_s

    @property
    def output_tokens_per_s(self) -> float:
        return self.output_tokens / self.elapsed_s

    def as_dict(self) -> dict:
        out = {
            "backend": self.backend,
            "elapsed_s": self.elapsed_s,
            "num_requests": self.num_requests,
            "total_input_tokens": self.input_tokens,
            "total_output_tokens": self.output_tokens,
            "requests_per_s": self.requests_per_s,
            "total_tokens_per_s": self.total_tokens_per_s,
            "output_tokens_per_s": self.output_tokens_per_s,
        }
        if self.generated_tokens is not None:
            out["generated_tokens"] = self.generated_tokens
        out.update(self.details)
        return out


def ratios(numerator: ThroughputResult, denominator: ThroughputResult) -> dict[str, float]:
    """numerator / denominator for each throughput (e.g. Podium over transformers)."""
    return {
        name: getattr(numerator, name) / getattr(denominator, name)
        for name in ("requests_per_s", "total_tokens_per_s", "output_tokens_per_s")
    }


def latency_summary(prefill_s: list[float], full_s: list[float], output_len: int, batch_size: int) -> dict:
    """Median prefill time and per-token decode time over iterations of one batch.

    decode per token = (full generate - prefill-only generate) / (output_len - 1): the time of the
    ``output_len - 1`` steps after the first token.
    """
    if len(prefill_s) != len(full_s) or not prefill_s:
        raise ValueError("need one prefill and one full timing per iteration, at least one iteration")
    if output_len < 2:
        raise ValueError(f"--output-len must be >= 2 to measure decode, got {output_len}")
    decode = [(f - p) / (output_len - 1) for p, f in zip(prefill_s, full_s)]
    return {
        "batch_size": batch_size,
        "output_len": output_len,
        "num_iters": len(full_s),
        "prefill_s_median": float(np.median(prefill_s)),
        "decode_per_token_s_median": float(np.median(decode)),
        "full_s_median": float(np.median(full_s)),
        "decode_tokens_per_s": batch_size / float(np.median(decode)) if np.median(decode) > 0 else float("inf"),
        "prefill_s": list(prefill_s),
        "full_s": list(full_s),
        "decode_per_token_s": decode,
    }
