"""The routing rule.

For each healthy replica r, estimate the request's time to first token:

    ttft(r) = (queued_tokens(device(r)) + uncached_prompt_tokens(r)) / prefill_rate(r)
              + decode_step(r)                      if requests are running there
              + ahead(r) * request_decode(r) / slots(r)

``queued_tokens``: the work ahead of the request there, in tokens (the larger of the replica's
own report and the router's pending count, updated on every routed request and first byte: see
``replica``), summed over the replicas on r's hardware device: Podium replicas reporting one
``device_key`` (several servers on one GPU, or on one host's cores) time-share it, so work queued
on a neighbour delays r as much as its own, and moving a request from the holder of its prefix to
a neighbour saves no queue while it recomputes the prefix and evicts another one.
``uncached_prompt_tokens``: the prompt less the leading blocks that replica holds in its prefix
cache (exact from its KV events). ``prefill_rate``: tokens per second, learned from the
replica's own metrics (prompt tokens computed over the step seconds they took), so a slow replica
(a CPU beside GPUs) takes a request only when it would really answer it sooner. The decode terms
keep short prompts from piling onto one replica: the request's prefill step carries the running
decodes (``decode_step``: a decode-only step's time, from the replica's metrics), and when the
replica's ``slots`` (its ``max_num_seqs``) are all taken it waits for ``ahead`` = requests there
- slots + 1 of them to finish, one every ``request_decode / slots`` (``request_decode``: first byte
to last of its requests, measured by the router). A term not measured yet takes the mean of the
replicas that have it (the prefill rate: ``default_rate`` if none has).

Replicas of one hardware class (Podium replicas reporting the same model, platform and device) share
each measured term: the mean of what each of them measured. Their rates differ only by noise and by
when each was last measured, and the rule must not turn that into routing: a replica whose only
sample came from a slow moment (its first requests, a neighbour's burst on a shared host) would
look slow, lose every comparison, and so never be measured again, while the prefix it holds is
recomputed elsewhere. Between identical replicas only queued work and cached prefixes then decide.

Pick the minimum, among replicas under their decode cap (requests in flight < the replica's
``max_num_seqs``, or ``decode_cap`` for replicas that don't report one); only when every replica is
at its cap are capped ones considered. Ties (equal estimates, e.g. an idle fleet of one speed) go
to the replica with fewer requests in flight, then round the fleet. Over identical replicas the
rule reduces to cache-aware least-load: the holder of a prefix wins until the work queued on it
outweighs the prefill the others would have to redo.

``round-robin`` ignores all of this (for comparison in benchmarks).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass

from .replica import Replica

POLICIES = ("ttft", "round-robin")


@dataclass(frozen=True)
class Candidate:
    replica: Replica
    ttft_s: float  # the estimate (0 for round-robin)
    cached_tokens: int
    uncached_tokens: int


class Router:
    """Ranks the healthy replicas for one request: best first (the rest are the retry order)."""

    def __init__(self, policy: str = "ttft", default_rate: float = 2000.0, decode_cap: int = 256) -> None:
        if policy not in POLICIES:
            raise ValueError(f"policy must be one of {', '.join(POLICIES)}, got {policy!r}")
        if default_rate <= 0:
            raise ValueError(f"default_rate must be > 0 tokens/s, got {default_rate}")
        self.policy, self.default_rate, self.decode_cap = policy, default_rate, decode_cap
        self._turn = itertools.count()

    def rank(self, replicas: list[Replica], num_tokens: int,
             hashes_for: Callable[[Replica], list[str]]) -> list[Candidate]:
        """``hashes_for(replica)``: the request's block hashes as that replica's prefix cache names them
        (its block size; its own key for the request's LoRA adapter)."""
        healthy = [r for r in replicas if r.routable]
        if not healthy:
            return []
        turn = next(self._turn)
        if self.policy == "round-robin":
            start = turn % len(healthy)
            return [self._candidate(r, num_tokens, hashes_for, None) for r in healthy[start:] + healthy[:start]]
        terms = _ClassTerms(healthy, self.default_rate)
        candidates = [self._candidate(r, num_tokens, hashes_for, terms) for r in healthy]
        order = {r.id: (i - turn) % len(healthy) for i, r in enumerate(healthy)}
        return sorted(candidates, key=lambda c: (c.replica.at_decode_cap(self.decode_cap), round(c.ttft_s, 6),
                                                 c.replica.in_flight, order[c.replica.id]))

    def _candidate(self, replica: Replica, num_tokens: int, hashes_for: Callable[[Replica], list[str]],
                   terms: _ClassTerms | None) -> Candidate:
        hashes = hashes_for(replica) if num_tokens else []
        cached = min(replica.cached_blocks(hashes) * replica.block_size, num_tokens)
        uncached = num_tokens - cached
        ttft = 0.0 if terms is None else self.estimate(replica, uncached, terms)
        return Candidate(replica, ttft, cached, uncached)

    def estimate(self, replica: Replica, uncached_tokens: int, terms: _ClassTerms) -> float:
        """The rule (module docstring) for one replica, in seconds."""
        prefill = (terms.queued_tokens(replica) + uncached_tokens) / terms.rate(replica)
        requests = replica.requests
        decode_step = terms.step_time(replica) if requests else 0.0
        slots = replica.max_num_seqs or self.decode_cap
        ahead = max(0, requests - slots + 1)
        return prefill + decode_step + ahead * terms.decode_time(replica) / slots


class _Fallbacks:
    """The fleet's mean of each measured term, for replicas that have not measured it yet."""

    def __init__(self, replicas: list[Replica], default_rate: float) -> None:
        self.rate = _mean([r.rate.value for r in replicas], default_rate)
        self.step_time = _mean([r.step_time.value for r in replicas], 0.0)
        self.decode_time = _mean([r.decode_time.value for r in replicas], 0.0)


class _ClassTerms:
    """Each measured term of one replica as the rule uses it: the mean over the replicas of its
    hardware class (itself alone if it has none), else the fleet's fallback."""

    def __init__(self, replicas: list[Replica], default_rate: float) -> None:
        self.fleet = _Fallbacks(replicas, default_rate)
        self._classes: dict[tuple, list[Replica]] = {}
        self._queued: dict[tuple, int] = {}  # queued tokens per hardware device
        for r in replicas:
            self._classes.setdefault(hardware_class(r), []).append(r)
            self._queued[device_of(r)] = self._queued.get(device_of(r), 0) + r.queued_tokens

    def queued_tokens(self, replica: Replica) -> int:
        """The work queued on ``replica``'s hardware device: its own and its co-located neighbours'."""
        return self._queued[device_of(replica)]

    def _peers(self, replica: Replica) -> list[Replica]:
        return self._classes.get(hardware_class(replica), [replica])

    def rate(self, replica: Replica) -> float:
        return _mean([r.rate.value for r in self._peers(replica)], self.fleet.rate)

    def step_time(self, replica: Replica) -> float:
        return _mean([r.step_time.value for r in self._peers(replica)], self.fleet.step_time)

    def decode_time(self, replica: Replica) -> float:
        return _mean([r.decode_time.value for r in self._peers(replica)], self.fleet.decode_time)


def hardware_class(replica: Replica) -> tuple:
    """What makes two replicas the same hardware for the rule: a Podium replica's model, platform and
    device as it reports them; any other replica is a class of its own."""
    if not replica.is_podium:
        return ("replica", replica.id)
    report = replica.report
    return ("podium", replica.model, report.get("platform"), report.get("device"), report.get("device_description"))


def device_of(replica: Replica) -> tuple:
    """The hardware device a replica computes on: a Podium replica's reported ``device_key``; a
    replica that reports none is a device of its own."""
    key = replica.report.get("device_key") if replica.is_podium else None
    return ("device", key) if key else ("replica", replica.id)


def _mean(values: list[float | None], default: float) -> float:
    known = [v for v in values if v]
    return sum(known) / len(known) if known else default
