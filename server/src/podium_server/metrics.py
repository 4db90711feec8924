"""Prometheus metrics (names prefixed ``podium:``), one private registry per app.

Request-level metrics (token counters, finish reasons, latency histograms) are updated by the
async engine as outputs arrive; engine-level gauges (running, waiting, KV-cache usage, prefix
cache) are read at scrape time from the engine's newest ``stats()`` snapshot (every report from the
engine loop carries one, in both engine modes).
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


class EngineStatsCollector(Collector):
    """Gauges and counters read from the engine's stats snapshot when Prometheus scrapes."""

    def __init__(self, read_stats: Callable[[], Any], model_name: str) -> None:
        self._read_stats = read_stats
        self._model = model_name

    def collect(self) -> Iterator[Metric]:
        stats = self._read_stats()
        yield self._gauge("num_requests_running", "Requests in the running batch", stats.num_running)
        yield self._gauge("num_requests_waiting", "Requests waiting to be scheduled", stats.num_waiting)
        yield self._gauge("kv_cache_usage_perc", "Fraction of KV-cache blocks in use (0..1)", stats.kv_cache_usage)
        yield self._gauge("num_free_kv_blocks", "Free KV-cache blocks", stats.num_free_blocks)
        yield self._gauge("num_kv_blocks", "KV-cache blocks in all", stats.num_total_blocks)
        yield self._counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache",
                            stats.prefix_cache_queries)
        yield self._counter("prefix_cache_hits", "Prompt tokens found in the prefix cache", stats.prefix_cache_hits)
        yield self._counter("num_preemptions", "Sequences preempted (recomputed later)", stats.num_preemptions)

    def _gauge(self, name: str, doc: str, value: float) -> GaugeMetricFamily:
        family = GaugeMetricFamily(f"podium:{name}", doc, labels=["model_name"])
        family.add_metric([self._model], value)
        return family

    def _counter(self, name: str, doc: str, value: float) -> CounterMetricFamily:
        family = CounterMetricFamily(f"podium:{name}", doc, labels=["model_name"])
        family.add_metric([self._model], value)
        return family


class ServerMetrics:
    """Request metrics; implements the async engine's ``OutputListener``."""

    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        labels, reg, model = ["model_name"], self.registry, [model_name]
        self.prompt_tokens = Counter("podium:prompt_tokens", "Prompt tokens processed", labels, registry=reg).labels(*model)
        self.generation_tokens = Counter("podium:generation_tokens", "Tokens generated", labels,
                                         registry=reg).labels(*model)
        self.finished = Counter("podium:request_success", "Requests finished, by finish reason",
                                ["model_name", "finished_reason"], registry=reg)
        self.ttft = Histogram("podium:time_to_first_token_seconds", "Time to first token", labels,
                              buckets=_LATENCY_BUCKETS, registry=reg).labels(*model)
        self.tpot = Histogram("podium:time_per_output_token_seconds", "Time per output token after the first",
                              labels, buckets=_TPOT_BUCKETS, registry=reg).labels(*model)
        self.e2e = Histogram("podium:e2e_request_latency_seconds", "End-to-end request latency", labels,
                             buckets=_LATENCY_BUCKETS, registry=reg).labels(*model)
        self._model = model_name

    def watch_engine(self, read_stats: Callable[[], Any]) -> None:
        self.registry.register(EngineStatsCollector(read_stats, self._model))

    def render(self, openmetrics: bool = False) -> bytes:
        """Prometheus' text format, or OpenMetrics (which carries the request-id exemplars)."""
        return openmetrics_exposition.generate_latest(self.registry) if openmetrics else generate_latest(self.registry)

    # -- OutputListener ------------------------------------------------------------------------
    def on_output(self, stream: RequestStream, output: Any, new_tokens: int) -> None:
        if new_tokens > 0:
            self.generation_tokens.inc(new_tokens)
            if stream.num_generated == new_tokens:  # the first tokens of this request
                self.ttft.observe(stream.first_token_time - stream.arrival_time)
        if output.finished:  # a delta: the stream has the counts and reasons of every sample
            self._finish(stream, list(stream.finish_reasons.values()) or ["stop"],
                         max(stream.sample_tokens.values(), default=0))

    def on_abort(self, stream: RequestStream) -> None:
        self._finish(stream, ["abort"], 0)

    def _finish(self, stream: RequestStream, reasons: list[str], longest: int) -> None:
        self.prompt_tokens.inc(stream.num_prompt_tokens)
        for reason in reasons:
            self.finished.labels(self._model, reason).inc()
        if longest > 1 and stream.first_token_time is not None and stream.last_token_time is not None:
            self.tpot.observe((stream.last_token_time - stream.first_token_time) / (longest - 1))
        exemplar = {"request_id": stream.trace_id} if stream.trace_id else None
        self.e2e.observe(time.monotonic() - stream.arrival_time, exemplar)
