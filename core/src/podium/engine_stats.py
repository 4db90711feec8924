"""The engine's counters (``LLMEngine.stats``), in a module of their own: the server process of
``--engine-mode process`` unpickles them every step and must not import the engine (torch) for it."""

from __future__ import annotations

from dataclasses import dataclass

from .spec.metrics import SpecDecodingStats


@dataclass
class EngineStats:
    num_running: int
    num_waiting: int
    num_free_blocks: int
    num_total_blocks: int
    kv_cache_usage: float
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_preemptions: int
    # the router's inputs (podium_server.replica): work ahead of a new request and the decode load,
    # in tokens; cumulative prompt tokens computed and their share of the step seconds (the prefill
    # rate); cumulative decode-only steps and their seconds (the decode step time)
    queued_tokens: int = 0
    running_tokens: int = 0
    prefill_tokens: int = 0
    prefill_seconds: float = 0.0
    decode_steps: int = 0
    decode_seconds: float = 0.0
    spec_decoding: SpecDecodingStats | None = None  # None: speculative decoding is off
