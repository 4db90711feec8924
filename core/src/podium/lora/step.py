"""The runner's side of LoRA: adapters held on the host (an LRU of ``max_cpu_loras``), written into
device slots when a plan says so, and each step's per-row slots staged for the layers.

Every rank runs this with the same plans: a plan's ``lora_loads`` name (slot, adapter) pairs the
scheduler assigned since the last plan, and each rank prepares the adapter for its own shard
(``LoRAModel.prepare``: its slices) from its host cache, reading the folder on a miss. A plan's
``lora_slots`` give each sequence's slot (-1: none); the per-row slots follow from its query lengths.
"""

from __future__ import annotations

import logging
from collections import OrderedDict

import numpy as np

from .peft_folder import read_adapter
from .request import AdapterRef
from .transform import LoRAModel, PreparedAdapter

logger = logging.getLogger(__name__)


class AdapterCache:
    """Prepared adapters on the host by key, least recently used evicted past ``capacity``."""

    def __init__(self, lora: LoRAModel, capacity: int) -> None:
        self.lora, self.capacity = lora, capacity
        self._entries: OrderedDict[int, PreparedAdapter] = OrderedDict()

    def __contains__(self, key: int) -> bool:
        return key in self._entries

    def get(self, ref: AdapterRef) -> PreparedAdapter:
        """``ref``'s adapter, read from its folder and prepared if it is not held (AdapterError if unfit)."""
        entry = self._entries.get(ref.key)
        if entry is None:
            logger.debug("LoRA adapter %r read again from %s (max_cpu_loras=%d)", ref.name, ref.path, self.capacity)
            entry = self.lora.prepare(read_adapter(ref.path), ref.name)
        self.put(ref.key, entry)
        return entry

    def put(self, key: int, adapter: PreparedAdapter) -> None:
        self._entries[key] = adapter
        self._entries.move_to_end(key)
        while len(self._entries) > self.capacity:
            self._entries.popitem(last=False)

    def drop(self, key: int) -> None:
        self._entries.pop(key, None)


class LoRAStep:
    """Slot loads and the per-row slot mapping of each step, for one rank's ``LoRAModel``."""

    def __init__(self, lora: LoRAModel, max_cpu_loras: int) -> None:
        self.lora, self.state = lora, lora.state
        self.cache = AdapterCache(lora, max_cpu_loras)
        self.graphs_have_adapters = True  # whether captured decode graphs compute the adapters' deltas

    def register(self, name: str, path: str, key: int) -> int:
        """Read and check adapter ``name`` from ``path`` and hold it under ``key``; returns its rank
        (the engine's registry calls this; AdapterError naming what does not fit)."""
        adapter = read_adapter(path)
        self.cache.put(key, self.lora.prepare(adapter, name))
        return adapter.rank

    def forget(self, key: int) -> None:
        self.cache.drop(key)

    def load(self, loads: list[tuple[int, AdapterRef]]) -> None:
        """Write each (slot, adapter) pair of a plan into its slot."""
        for slot, ref in loads:
            self.lora.write(slot, self.cache.get(ref))
            logger.debug("LoRA adapter %r in slot %d", ref.name, slot)

    def graph_serves(self, lora_slots: list[int] | None) -> bool:
        """Whether a captured graph may run a step with these sequence slots."""
        return self.graphs_have_adapters or lora_slots is None

    def stage(self, lora_slots: list[int] | None, query_lens: list[int], graph_rows: int | None) -> None:
        """Stage the step's mapping: per row, its sequence's slot (``lora_slots`` [S], None: no adapters)."""
        rows = None
        if lora_slots is not None:
            rows = np.repeat(np.asarray(lora_slots, dtype=np.int32), np.asarray(query_lens, dtype=np.int64))
        self.state.stage(rows, graph_rows)
