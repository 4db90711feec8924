"""The router's Prometheus metrics (names prefixed ``podium_router:``), one private registry per app.

Per replica (label ``replica``): requests by outcome (``ok``, ``client_error``, ``cut`` mid-stream,
``client_gone``),
retries onto it, prompt tokens routed to it and how many of them it held in its prefix cache when
routed (their ratio is the routed prefix hit rate), generated tokens (from the usage the replica
reports), time to the first byte; and, read from the replica set at scrape time, its health, its
queued tokens, requests in flight, learned prefill rate and cached blocks. Fleet-wide figures are
sums over the label; ``healthy_replicas`` counts the replicas in routing.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from .replica import HEALTHY, Replica

_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)


class ReplicaCollector(Collector):
    def __init__(self, replicas: Callable[[], list[Replica]]) -> None:
        self._replicas = replicas

    def collect(self) -> Iterator[Metric]:
        replicas = self._replicas()
        gauges = {
            "replica_healthy": ("1 if the replica is in routing", lambda r: float(r.state == HEALTHY)),
            "replica_queued_tokens": ("Work ahead of a new request on the replica, in tokens", lambda r: r.queued_tokens),
            "replica_in_flight": ("Requests the router has in flight on the replica", lambda r: r.in_flight),
            "replica_prefill_rate": ("Learned prefill rate, tokens/s (0: not known yet)", lambda r: r.rate.value or 0.0),
            "replica_cached_blocks": ("Prefix-cache blocks the replica holds (from its KV events)",
                                      lambda r: len(r.cached)),
        }
        for name, (doc, value) in gauges.items():
            family = GaugeMetricFamily(f"podium_router:{name}", doc, labels=["replica", "platform"])
            for r in replicas:
                family.add_metric([r.name, str(r.report.get("platform", ""))], value(r))
            yield family
        healthy = GaugeMetricFamily("podium_router:healthy_replicas", "Replicas in routing")
        healthy.add_metric([], sum(r.state == HEALTHY for r in replicas))
        yield healthy


class RouterMetrics:
    def __init__(self) -> None:
        self.registry = reg = CollectorRegistry(auto_describe=True)
        self.requests = Counter("podium_router:requests", "Requests answered, by replica and outcome",
                                ["replica", "outcome"], registry=reg)
        self.retries = Counter("podium_router:retries", "Attempts moved onto this replica after another failed",
                               ["replica"], registry=reg)
        self.no_replica = Counter("podium_router:no_healthy_replica", "Requests refused: no healthy replica",
                                  registry=reg)
        self.prompt_tokens = Counter("podium_router:routed_prompt_tokens", "Prompt tokens routed", ["replica"],
                                     registry=reg)
        self.cached_tokens = Counter("podium_router:routed_cached_tokens",
                                     "Routed prompt tokens the replica held in its prefix cache", ["replica"],
                                     registry=reg)
        self.generation_tokens = Counter("podium_router:generation_tokens", "Tokens generated (replicas' usage)",
                                         ["replica"], registry=reg)
        self.ttfb = Histogram("podium_router:time_to_first_byte_seconds", "Routing to the replica's first byte",
                              ["replica"], buckets=_BUCKETS, registry=reg)

    def watch(self, replicas: Callable[[], list[Replica]]) -> None:
        self.registry.register(ReplicaCollector(replicas))

    def routed(self, replica: str, candidate, ttfb_s: float) -> None:
        self.prompt_tokens.labels(replica).inc(candidate.cached_tokens + candidate.uncached_tokens)
        self.cached_tokens.labels(replica).inc(candidate.cached_tokens)
        self.ttfb.labels(replica).observe(ttfb_s)

    def render(self) -> bytes:
        return generate_latest(self.registry)
