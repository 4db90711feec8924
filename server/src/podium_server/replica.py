"""What a replica tells a router (``podium router``): a small, versioned API under ``/podium/v1``.

``GET /podium/v1/replica``: the model, platform and device (``device_key``: the hardware's
identity from ``Platform.device_key``, equal for replicas that share it), the KV cache's capacity in tokens,
the load in tokens (``queued_tokens``: what every unfinished request still has to compute, the
work ahead of a new one, where a waiting prompt's cached leading blocks do not count;
``running_tokens``: the running batch's tokens, its decode load), the
cumulative prompt tokens computed and the step seconds they took (a router derives the prefill
rate from two reports), the prefix cache's block hash scheme with the KV-event position, and the
LoRA adapters loaded now (``lora.adapters``: each one's name, folder and ``block_hash_extra``, the
text its blocks' hashes digest after the token ids; it changes with ``/v1/load_lora_adapter`` and
``/v1/unload_lora_adapter``), so a router sends a request naming an adapter only where it is
loaded and hashes its prompt as that replica's block manager does.

``GET /podium/v1/kv_events?after=SEQ&epoch=EPOCH&timeout=S``: the prefix cache's block events,
long-polled. Each event is one run of block hashes stored or evicted, in the engine's order,
numbered 1, 2, ... within an ``epoch`` (a new one per server start). The answer holds the events
after ``after`` (waiting up to ``timeout`` seconds for one); if the router's position cannot be
continued (another epoch, events dropped from the bounded log, or a position from the future) it
is a ``reset``: every hash cached now, and the position to poll on from. Hashes are 32 hex digits
(the 128-bit chained hash of ``podium.block_manager.hash_block_tokens``; a router recomputes them
from token ids to know which replica holds a prompt's prefix; the blocks of a request with a LoRA
adapter hash that adapter's ``block_hash_extra`` too, which differs between replicas).
"""

from __future__ import annotations

import asyncio
import uuid
from collections import deque

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from .errors import bad_request

API_VERSION = 1
MAX_EVENTS = 4096  # runs kept for pollers that fall behind; beyond that they get a reset
MAX_POLL_S = 30.0


class KVEventLog:
    """The engine's block events as numbered runs, plus the set of hashes cached now (for resets)."""

    def __init__(self, max_events: int = MAX_EVENTS) -> None:
        self.epoch = uuid.uuid4().hex[:16]
        self.seq = 0
        self._events: deque[tuple[int, str, list[str]]] = deque(maxlen=max_events)
        self._stored: dict[str, None] = {}  # insertion-ordered: a reset lists the oldest first
        self._changed = asyncio.Event()

    def append(self, events: list[tuple[str, int]]) -> None:
        """Take one report's events (``("stored" | "evicted", hash)``, in order); wake the pollers."""
        run_kind, run = None, []
        for kind, block_hash in events:
            key = f"{block_hash:032x}"
            if kind == "stored":
                self._stored[key] = None
            else:
                self._stored.pop(key, None)
            if kind != run_kind and run:
                self._push(run_kind, run)
                run = []
            run_kind = kind
            run.append(key)
        if run:
            self._push(run_kind, run)
        self.wake()

    def wake(self) -> None:
        """End every poll waiting now (new events, or the server is draining: nothing will come)."""
        self._changed.set()
        self._changed = asyncio.Event()

    def _push(self, kind: str, hashes: list[str]) -> None:
        self.seq += 1
        self._events.append((self.seq, kind, hashes))

    def since(self, after: int, epoch: str | None) -> dict:
        """The answer to a poll from position ``after`` in ``epoch`` (see the module docstring)."""
        oldest = self._events[0][0] if self._events else self.seq + 1
        if epoch != self.epoch or after > self.seq or after < oldest - 1:
            return {"epoch": self.epoch, "seq": self.seq, "reset": True, "block_hashes": list(self._stored)}
        events = [{"seq": seq, "type": kind, "block_hashes": hashes} for seq, kind, hashes in self._events
                  if seq > after]
        return {"epoch": self.epoch, "seq": self.seq, "reset": False, "events": events}

    async def wait(self, after: int, timeout: float) -> None:
        """Return when there is an event after ``after``, or after ``timeout`` seconds."""
        if self.seq > after:
            return
        try:
            await asyncio.wait_for(self._changed.wait(), timeout)
        except asyncio.TimeoutError:
            pass


def replica_report(app: FastAPI) -> dict:
    ctx, log = app.state.ctx, app.state.kv_log
    info, stats = ctx.engine.info, ctx.engine.stats
    return {
        "version": API_VERSION,
        "model": info.model_name,
        "aliases": sorted(ctx.model_aliases),
        "max_model_len": info.max_model_len,
        "platform": info.platform_name,
        "device": info.device,
        "device_description": info.device_description,
        "device_key": info.device_key,
        "kv_capacity_tokens": info.kv_capacity_tokens,
        "max_num_seqs": info.max_num_seqs,
        "alive": ctx.engine.alive and not app.state.drain.draining,
        "draining": app.state.drain.draining,
        "load": {
            "queued_tokens": getattr(stats, "queued_tokens", 0),
            "running_tokens": getattr(stats, "running_tokens", 0),
            "num_running": stats.num_running,
            "num_waiting": stats.num_waiting,
            "kv_cache_usage": stats.kv_cache_usage,
        },
        "prefill": {"tokens": getattr(stats, "prefill_tokens", 0), "seconds": getattr(stats, "prefill_seconds", 0.0)},
        "decode": {"steps": getattr(stats, "decode_steps", 0), "seconds": getattr(stats, "decode_seconds", 0.0)},
        "prefix_cache": {
            "block_hash_scheme": info.block_hash_scheme,
            "block_size": info.block_size,
            "epoch": log.epoch,
            "seq": log.seq,
        },
        "lora": {
            "enabled": info.lora_enabled,
            "adapters": [{"name": a.name, "path": a.path, "block_hash_extra": a.block_hash_extra}
                         for a in ctx.engine.lora_adapters.values()],
        },
    }


def add_replica_routes(app: FastAPI) -> None:
    async def replica(request: Request) -> JSONResponse:
        return JSONResponse(replica_report(request.app))

    async def kv_events(request: Request, after: int = 0, epoch: str | None = None,
                        timeout: float = 0.0) -> JSONResponse:
        if after < 0 or not 0 <= timeout <= MAX_POLL_S:
            raise bad_request(f"after must be >= 0 and timeout in [0, {MAX_POLL_S:g}] seconds "
                              f"(got after={after}, timeout={timeout})")
        log: KVEventLog = request.app.state.kv_log
        if epoch == log.epoch and timeout > 0:
            await log.wait(after, timeout)
        return JSONResponse(log.since(after, epoch))

    app.add_api_route(f"/podium/v{API_VERSION}/replica", replica, methods=["GET"])
    app.add_api_route(f"/podium/v{API_VERSION}/kv_events", kv_events, methods=["GET"])
