"""Prometheus metrics (names prefixed ``podium:``), one private registry per app.

Request-level metrics (token counters, finish reasons, latency histograms) are updated by the
async engine as outputs arrive; engine-level gauges (running, waiting, KV-cache usage, prefix
cache) are read at scrape time from the engine's newest ``stats()`` snapshot (every report from the
engine loop carries one, in both engine modes).

The histograms are vLLM's, defined as vLLM defines them: time to first token, inter-token latency
(each gap between a request's token arrivals, per token), time per output token (per request),
end-to-end latency; the engine's phases from its own timestamps (queue: arrival to first
scheduled; prefill: first scheduled to first token; decode: first token to last token; inference:
first scheduled to last token); prompt and generation tokens per request (1-2-5 buckets up to the
model's context). With ``compat="vllm"`` (``--metrics-compat vllm``) every series is served a
second time under vLLM's name (``vllm:num_requests_running``, ``vllm:kv_cache_usage_perc``, ...)
so a vLLM dashboard reads it unchanged.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.openmetrics import exposition as openmetrics_exposition
from prometheus_client.registry import Collector

from .async_engine import RequestStream

OPENMETRICS = openmetrics_exposition.CONTENT_TYPE_LATEST
_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                    20.0, 40.0, 80.0, 160.0)
_TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
                 1.0, 2.5)
_PHASE_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
                  480.0, 960.0, 1920.0, 7680.0)
PREFIXES = {"none": ("podium",), "vllm": ("podium", "vllm")}


def buckets_1_2_5(limit: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to ``limit`` (vLLM's token-count buckets)."""
    out, base = [], 1
    while True:
        for m in (1, 2, 5):
            if m * base > limit:
                return out
            out.append(m * base)
        base *= 10


class _Fanout:
    """The same observation on one series per name prefix."""

    def __init__(self, children: list) -> None:
        self._children = children

    def inc(self, amount: float = 1) -> None:
        for child in self._children:
            child.inc(amount)

    def observe(self, value: float, exemplar: dict[str, str] | None = None) -> None:
        for child in self._children:
            child.observe(value, exemplar)


class EngineStatsCollector(Collector):
    """Gauges and counters read from the engine's stats snapshot when Prometheus scrapes."""

    def __init__(self, read_stats: Callable[[], Any], model_name: str, prefixes: tuple[str, ...] = ("podium",)) -> None:
        self._read_stats = read_stats
        self._model = model_name
        self._prefixes = prefixes

    def collect(self) -> Iterator[Metric]:
        stats = self._read_stats()
        for prefix in self._prefixes:
            yield from self._families(prefix, stats)

    def _families(self, prefix: str, stats: Any) -> Iterator[Metric]:
        self._prefix = prefix
        yield self._gauge("num_requests_running", "Requests in the running batch", stats.num_running)
        yield self._gauge("num_requests_waiting", "Requests waiting to be scheduled", stats.num_waiting)
        yield self._gauge("kv_cache_usage_perc", "Fraction of KV-cache blocks in use (0..1)", stats.kv_cache_usage)
        yield self._gauge("num_free_kv_blocks", "Free KV-cache blocks", stats.num_free_blocks)
        yield self._gauge("num_kv_blocks", "KV-cache blocks in all", stats.num_total_blocks)
        yield self._counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache",
                            stats.prefix_cache_queries)
        yield self._counter("prefix_cache_hits", "Prompt tokens found in the prefix cache", stats.prefix_cache_hits)
        yield self._counter("num_preemptions", "Sequences preempted (recomputed later)", stats.num_preemptions)
        spec = getattr(stats, "spec_decoding", None)
        if spec is not None:
            yield from self._spec_decoding(spec)

    def _spec_decoding(self, spec: Any) -> Iterator[Metric]:
        """Speculative decoding's counters (vLLM's names) and its derived rates."""
        yield self._counter("spec_decode_num_drafts", "Sequence-steps that verified draft tokens", spec.num_drafts)
        yield self._counter("spec_decode_num_draft_tokens", "Draft tokens proposed and verified",
                            spec.num_draft_tokens)
        yield self._counter("spec_decode_num_accepted_tokens", "Draft tokens accepted", spec.num_accepted_tokens)
        yield self._per_position(CounterMetricFamily, "spec_decode_num_draft_tokens_per_pos",
                                 "Draft tokens proposed, by position in the draft", spec.proposed_per_position)
        yield self._per_position(CounterMetricFamily, "spec_decode_num_accepted_tokens_per_pos",
                                 "Draft tokens accepted, by position in the draft", spec.accepted_per_position)
        yield self._per_position(GaugeMetricFamily, "spec_decode_acceptance_rate_per_pos",
                                 "Accepted / proposed draft tokens, by position in the draft",
                                 spec.acceptance_rate_per_position)
        yield self._gauge("spec_decode_acceptance_rate", "Accepted / proposed draft tokens", spec.acceptance_rate)
        yield self._gauge("spec_decode_mean_accepted_length",
                          "Tokens gained per verifying sequence-step (1 + accepted drafts)", spec.mean_accepted_length)

    def _per_position(self, kind, name: str, doc: str, values: list) -> Metric:
        family = kind(f"{self._prefix}:{name}", doc, labels=["model_name", "position"])
        for position, value in enumerate(values):
            family.add_metric([self._model, str(position)], value)
        return family

    def _gauge(self, name: str, doc: str, value: float) -> GaugeMetricFamily:
        family = GaugeMetricFamily(f"{self._prefix}:{name}", doc, labels=["model_name"])
        family.add_metric([self._model], value)
        return family

    def _counter(self, name: str, doc: str, value: float) -> CounterMetricFamily:
        family = CounterMetricFamily(f"{self._prefix}:{name}", doc, labels=["model_name"])
        family.add_metric([self._model], value)
        return family


class ServerMetrics:
    """Request metrics; implements the async engine's ``OutputListener``."""

    def __init__(self, model_name: str, compat: str = "none", max_model_len: int = 8192) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self._prefixes = PREFIXES[compat]
        self._model = model_name
        tokens = buckets_1_2_5(max_model_len)
        self.prompt_tokens = self._series(Counter, "prompt_tokens", "Prompt tokens processed")
        self.generation_tokens = self._series(Counter, "generation_tokens", "Tokens generated")
        self._finished = [Counter(f"{p}:request_success", "Requests finished, by finish reason",
                                  ["model_name", "finished_reason"], registry=self.registry) for p in self._prefixes]
        self.ttft = self._series(Histogram, "time_to_first_token_seconds", "Time to first token",
                                 buckets=_LATENCY_BUCKETS)
        self.itl = self._series(Histogram, "inter_token_latency_seconds", "Time between a request's successive tokens",
                                buckets=_TPOT_BUCKETS)
        self.tpot = self._series(Histogram, "time_per_output_token_seconds", "Time per output token after the first",
                                 buckets=_TPOT_BUCKETS)
        self.e2e = self._series(Histogram, "e2e_request_latency_seconds", "End-to-end request latency",
                                buckets=_LATENCY_BUCKETS)
        self.queue_time = self._series(Histogram, "request_queue_time_seconds",
                                       "Time a request waited before it was first scheduled", buckets=_PHASE_BUCKETS)
        self.prefill_time = self._series(Histogram, "request_prefill_time_seconds",
                                         "Time from first scheduled to first token", buckets=_PHASE_BUCKETS)
        self.decode_time = self._series(Histogram, "request_decode_time_seconds", "Time from first to last token",
                                        buckets=_PHASE_BUCKETS)
        self.inference_time = self._series(Histogram, "request_inference_time_seconds",
                                           "Time from first scheduled to last token", buckets=_PHASE_BUCKETS)
        self.request_prompt_tokens = self._series(Histogram, "request_prompt_tokens", "Prompt tokens per request",
                                                  buckets=tokens)
        self.request_generation_tokens = self._series(Histogram, "request_generation_tokens",
                                                      "Generated tokens per request (all samples)", buckets=tokens)

    def _series(self, kind, name: str, doc: str, **kwargs) -> _Fanout:
        return _Fanout([kind(f"{p}:{name}", doc, ["model_name"], registry=self.registry, **kwargs).labels(self._model)
                        for p in self._prefixes])

    def watch_engine(self, read_stats: Callable[[], Any]) -> None:
        self.registry.register(EngineStatsCollector(read_stats, self._model, self._prefixes))

    def render(self, openmetrics: bool = False) -> bytes:
        """Prometheus' text format, or OpenMetrics (which carries the request-id exemplars)."""
        return openmetrics_exposition.generate_latest(self.registry) if openmetrics else generate_latest(self.registry)

    # -- OutputListener ------------------------------------------------------------------------
    def on_output(self, stream: RequestStream, output: Any, new_tokens: int) -> None:
        if new_tokens > 0:
            self.generation_tokens.inc(new_tokens)
            if stream.num_generated == new_tokens:  # the first tokens of this request
                self.ttft.observe(stream.first_token_time - stream.arrival_time)
            elif stream.previous_token_time is not None:
                gap = (stream.last_token_time - stream.previous_token_time) / new_tokens
                for _ in range(min(new_tokens, 64)):
                    self.itl.observe(gap)
        if output.finished:  # a delta: the stream has the counts and reasons of every sample (a
            # pooling output has none: one embedding, "stop", no generated tokens)
            self._finish(stream, list(stream.finish_reasons.values()) or ["stop"],
                         max(stream.sample_tokens.values(), default=0))
            self._phases(getattr(output, "metrics", None))

    def on_abort(self, stream: RequestStream, reason: str = "abort") -> None:
        self._finish(stream, [reason], 0)

    def _finish(self, stream: RequestStream, reasons: list[str], longest: int) -> None:
        self.prompt_tokens.inc(stream.num_prompt_tokens)
        self.request_prompt_tokens.observe(stream.num_prompt_tokens)
        self.request_generation_tokens.observe(stream.num_generated)
        for reason in reasons:
            for counter in self._finished:
                counter.labels(self._model, reason).inc()
        if longest > 1 and stream.first_token_time is not None and stream.last_token_time is not None:
            self.tpot.observe((stream.last_token_time - stream.first_token_time) / (longest - 1))
        exemplar = {"request_id": stream.trace_id} if stream.trace_id else None
        self.e2e.observe(time.monotonic() - stream.arrival_time, exemplar)

    def _phases(self, metrics: Any) -> None:
        """The engine's own timestamps of a finished request (wall clock, one clock for all)."""
        if metrics is None or metrics.first_scheduled_time is None:
            return
        scheduled = metrics.first_scheduled_time
        self.queue_time.observe(max(0.0, scheduled - metrics.arrival_time))
        if metrics.first_token_time is not None:
            self.prefill_time.observe(max(0.0, metrics.first_token_time - scheduled))
            last = metrics.last_token_time or metrics.first_token_time
            self.decode_time.observe(max(0.0, last - metrics.first_token_time))
            self.inference_time.observe(max(0.0, last - scheduled))
