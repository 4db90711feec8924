"""What the router knows about one replica: its report, its learned prefill rate, the prefixes it
holds, and the router's own accounting of the requests it sent there.

Models served. A Podium replica serves its model (and the aliases it reports) and the LoRA adapters
its report lists now (loaded at startup or through ``/v1/load_lora_adapter``; a report follows loads
and unloads, so the router's view lags them by at most a poll). A replica that is not Podium reports
nothing: any model may be sent there, and it answers for itself.

Prefixes held. A Podium replica's KV events give the exact set of block hashes in its prefix cache
(``cached``). Between routing a request and the events of its blocks there is a gap (the request
waits, prefills, the event travels), so the blocks of requests routed there and not finished yet
count as held too (``promised``): they will be in the cache by the time a request routed now
reaches its prefill. A replica without KV events (not Podium, or a hash scheme the router does
not know) gets an approximate record instead: an LRU of the block hashes of what was routed there,
bounded by its KV capacity (or ``approx_capacity_tokens``).

Load. ``queued_tokens`` is the larger of the replica's own report (fresh every poll, counts every
client) and the router's pending prefill work there (fresh on every routed request and first
byte): the router's own count is exact for its traffic, the report catches the rest.
"""

from __future__ import annotations

import itertools
import time
from collections import Counter, OrderedDict
from dataclasses import dataclass, field

from .hashing import BLOCK_HASH_SCHEME

HEALTHY, UNHEALTHY, DRAINING = "healthy", "unhealthy", "draining"
_ids = itertools.count(1)


class Estimate:
    """A ratio learned as an exponentially weighted mean of measured samples (tokens per second,
    seconds per step, ...); None until the first sample."""

    def __init__(self, weight: float = 0.3) -> None:
        self.value: float | None = None
        self._weight = weight

    def add(self, amount: float, per: float) -> None:
        if amount <= 0 or per <= 0:
            return
        sample = amount / per
        self.value = sample if self.value is None else (1 - self._weight) * self.value + self._weight * sample


class RoutedPrefixes:
    """Block hashes of what was routed to a replica, least recently used first, bounded in blocks."""

    def __init__(self, max_blocks: int) -> None:
        self.max_blocks = max(1, max_blocks)
        self._lru: OrderedDict[str, None] = OrderedDict()

    def add(self, hashes: list[str]) -> None:
        for h in hashes:
            self._lru[h] = None
            self._lru.move_to_end(h)
        while len(self._lru) > self.max_blocks:
            self._lru.popitem(last=False)

    def __contains__(self, block_hash: str) -> bool:
        return block_hash in self._lru

    def __len__(self) -> int:
        return len(self._lru)


@dataclass
class Replica:
    url: str
    name: str = ""
    source: str = "static"  # who added it: "static" (flags), "file", "admin", "fleet"
    state: str = UNHEALTHY  # until its first health check passes
    is_podium: bool = False  # answers /podium/v1/replica
    report: dict = field(default_factory=dict)
    model: str = ""
    adapters: dict[str, dict] = field(default_factory=dict)  # LoRA adapters loaded there, by name (its report)
    block_size: int = 16
    max_num_seqs: int = 0  # the decode cap (0: not known)
    kv_capacity_tokens: int = 0
    exact_prefixes: bool = False  # KV events under a known scheme
    cached: set[str] = field(default_factory=set)  # from KV events
    kv_epoch: str | None = None
    kv_seq: int = 0
    promised: Counter = field(default_factory=Counter)  # block hash -> requests in flight carrying it
    routed: RoutedPrefixes | None = None  # approximate record (no KV events)
    rate: Estimate = field(default_factory=Estimate)  # prefill tokens/s (its reports)
    step_time: Estimate = field(default_factory=Estimate)  # seconds of a decode-only step (its reports)
    decode_time: Estimate = field(default_factory=Estimate)  # first byte to last of a request (the router's)
    pending_prefill: int = 0  # uncached prompt tokens of requests routed here, no byte back yet
    in_flight: int = 0  # requests routed here, not finished
    failures: int = 0  # consecutive failed checks
    last_counters: tuple[int, float, int, float] | None = None  # the previous report's prefill/decode counters
    added_at: float = field(default_factory=time.monotonic)
    id: int = field(default_factory=lambda: next(_ids))

    def __post_init__(self) -> None:
        self.url = self.url.rstrip("/")
        self.name = self.name or self.url

    # -- what it reported -------------------------------------------------------------------------
    def apply_report(self, report: dict, approx_capacity_tokens: int) -> None:
        self.is_podium, self.report = True, report
        self.model = report.get("model", self.model)
        listed = (report.get("lora") or {}).get("adapters") or ()
        self.adapters = {a["name"]: a for a in listed if isinstance(a, dict) and isinstance(a.get("name"), str)}
        self.max_num_seqs = int(report.get("max_num_seqs") or 0)
        self.kv_capacity_tokens = int(report.get("kv_capacity_tokens") or 0)
        cache = report.get("prefix_cache") or {}
        self.block_size = int(cache.get("block_size") or self.block_size)
        exact = cache.get("block_hash_scheme") == BLOCK_HASH_SCHEME
        if not exact and self.exact_prefixes:
            self.cached.clear()
        self.exact_prefixes = exact
        if not exact and self.routed is None:
            self.routed = RoutedPrefixes((self.kv_capacity_tokens or approx_capacity_tokens) // self.block_size)
        prefill, decode = report.get("prefill") or {}, report.get("decode") or {}
        counters = (int(prefill.get("tokens", 0)), float(prefill.get("seconds", 0.0)),
                    int(decode.get("steps", 0)), float(decode.get("seconds", 0.0)))
        last = self.last_counters or (0, 0.0, 0, 0.0)  # none yet: the replica's whole life so far
        self.rate.add(counters[0] - last[0], counters[1] - last[1])
        self.step_time.add(counters[3] - last[3], counters[2] - last[2])
        self.last_counters = counters

    def apply_unreported(self, approx_capacity_tokens: int) -> None:
        """Not Podium: no report, no KV events; keep an approximate record of what was routed here."""
        self.is_podium, self.exact_prefixes = False, False
        self.routed = RoutedPrefixes(approx_capacity_tokens // self.block_size)

    def apply_kv_events(self, answer: dict) -> None:
        """One answer of ``/podium/v1/kv_events`` (a reset or the events after ``kv_seq``)."""
        if answer.get("reset"):
            self.cached = set(answer.get("block_hashes") or ())
        else:
            for event in answer.get("events") or ():
                if event["type"] == "stored":
                    self.cached.update(event["block_hashes"])
                else:
                    self.cached.difference_update(event["block_hashes"])
        self.kv_epoch, self.kv_seq = answer.get("epoch"), int(answer.get("seq", 0))

    def forget_server(self) -> None:
        """The replica went away: what it cached and reported is gone with it."""
        self.cached.clear()
        self.adapters = {}
        self.kv_epoch, self.kv_seq, self.last_counters = None, 0, None

    # -- what the router sees -----------------------------------------------------------------------
    @property
    def routable(self) -> bool:
        return self.state == HEALTHY

    def serves(self, model: str) -> bool:
        """Whether a request naming ``model`` may be sent here (see "Models served" above)."""
        return not self.model or self._is_base(model) or model in self.adapters

    def block_hash_extra(self, model: str | None) -> str | None:
        """What this replica's block hashes add for a request naming ``model``: on a Podium replica its
        adapter's ``block_hash_extra`` where ``model`` is an adapter loaded here, else None (the base
        model). A replica that is not Podium does not say which of its models are adapters, so its
        approximate record keeps each named model's prefixes apart (the model's name)."""
        if not model or self._is_base(model):
            return None
        if not self.is_podium:
            return f"model={model}"
        adapter = self.adapters.get(model)
        return adapter.get("block_hash_extra") if adapter else None

    def _is_base(self, model: str) -> bool:
        return model == self.model or model in self.report.get("aliases", ())

    @property
    def queued_tokens(self) -> int:
        reported = int((self.report.get("load") or {}).get("queued_tokens", 0))
        return max(reported, self.pending_prefill)

    @property
    def requests(self) -> int:
        """Requests running or waiting there: the replica's count, or the router's if larger."""
        load = self.report.get("load") or {}
        return max(int(load.get("num_running", 0)) + int(load.get("num_waiting", 0)), self.in_flight)

    def at_decode_cap(self, default_cap: int) -> bool:
        cap = self.max_num_seqs or default_cap
        return cap > 0 and self.in_flight >= cap

    def cached_blocks(self, hashes: list[str]) -> int:
        """How many leading blocks of ``hashes`` this replica holds (or will, see the module docstring)."""
        record = self.cached if self.exact_prefixes else (self.routed or ())
        count = 0
        for h in hashes:
            if h not in record and h not in self.promised:
                break
            count += 1
        return count

    # -- the router's own accounting ------------------------------------------------------------------
    def routed_request(self, hashes: list[str], uncached_tokens: int) -> None:
        self.in_flight += 1
        self.pending_prefill += uncached_tokens
        self.promised.update(hashes)
        if self.routed is not None:
            self.routed.add(hashes)

    def first_byte(self, uncached_tokens: int) -> None:
        self.pending_prefill = max(0, self.pending_prefill - uncached_tokens)

    def finished_request(self, hashes: list[str]) -> None:
        self.in_flight = max(0, self.in_flight - 1)
        self.promised.subtract(hashes)
        for h in hashes:
            if self.promised[h] <= 0:
                del self.promised[h]

    def describe(self) -> dict:
        return {"id": self.id, "name": self.name, "url": self.url, "source": self.source, "state": self.state,
                "podium": self.is_podium, "model": self.model, "lora_adapters": sorted(self.adapters),
                "platform": self.report.get("platform"),
                "device": self.report.get("device_description") or self.report.get("device"),
                "device_key": self.report.get("device_key"),
                "exact_prefixes": self.exact_prefixes, "cached_blocks": len(self.cached),
                "prefill_rate": self.rate.value, "decode_step_s": self.step_time.value,
                "request_decode_s": self.decode_time.value, "queued_tokens": self.queued_tokens,
                "in_flight": self.in_flight, "pending_prefill_tokens": self.pending_prefill}
