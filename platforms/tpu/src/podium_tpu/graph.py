"""Graph capture on XLA is compilation: run the step once at a bucketed shape, cut the graph there.

``capture(fn)`` traces ``fn`` and synchronizes, which compiles the step's graph for those tensor
shapes (the slow part, timed in ``compile_seconds``) and runs it. A replay traces ``fn`` again on
the same static tensors and synchronizes: the graph hashes the same, so XLA takes it from its
compilation cache and only runs it. Synchronizing at the end of every replay also materializes the
step's in-place KV-cache writes, so no lazy graph carries over into the next step.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from podium_plugin_api import AttentionMetadata, GraphRunner


def cut_graph() -> None:
    """Launch every pending lazy operation as one graph (non-blocking); later ops start a new graph."""
    import torch_xla

    torch_xla.sync()


class StepBoundary:
    """Mixin for attention backends: start every step from materialized KV caches.

    The layers write the caches in place; on XLA those writes stay lazy until something cuts the
    graph. If nothing did between steps, each step's graph would contain every earlier step's
    writes: a new, longer graph and a recompilation per step. ``prepare_metadata`` runs once per
    step before the layers, so it cuts there. Where the core already synchronized after the last
    step, nothing is pending and this costs nothing. ``sync`` is None for plain CPU tensors.
    """

    def __init__(self, sync: Callable[[], None] | None = None) -> None:
        self._sync = sync

    def prepare_metadata(self, meta: AttentionMetadata) -> AttentionMetadata:
        if self._sync is not None:
            self._sync()
        return meta


class XlaGraphRunner(GraphRunner):
    def __init__(self, synchronize: Callable[[], None]) -> None:
        self._synchronize = synchronize
        self.compile_seconds: list[float] = []  # one entry per capture

    def capture(self, fn: Callable[[], Any]) -> Callable[[], Any]:
        begin = time.perf_counter()
        fn()
        self._synchronize()
        self.compile_seconds.append(time.perf_counter() - begin)

        def replay() -> Any:
            out = fn()
            self._synchronize()
            return out

        return replay
