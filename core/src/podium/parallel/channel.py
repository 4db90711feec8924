"""How rank 0 sends each step's plan (any picklable object) to the other tensor-parallel ranks.

Two channels, one interface (``send(obj)`` on rank 0, ``recv()`` elsewhere), picked by
``EngineConfig.plan_broadcast``:

``ShmRing`` ("shm"): a ring of ``SLOTS`` message slots in one shared-memory block, one writer, one
read counter per reader::

    header int64 [SLOTS written-seq | SLOTS lengths | readers' read counts]   payload [SLOTS x SLOT_BYTES]

Message m goes to slot m % SLOTS once every reader has read message m - SLOTS; the writer copies
the pickled bytes, then publishes ``written[slot] = m + 1``; a reader waits for that number, copies
the bytes out and bumps its read count. Waiting spins briefly, then sleeps in growing steps (an idle
rank leaves its core to the others); every wait checks ``alive`` so a dead peer ends it. The header
stores are ordered by x86's total store order (the CPython stores are plain int64 writes).

``TorchBroadcast`` ("torch"): the pickled bytes' length, then the bytes, broadcast from rank 0 over a
gloo group (host tensors, whatever the device backend).

``benchmarks/tp_cpu.py`` measures both; docs/performance.md has the numbers behind the default.
"""

from __future__ import annotations

import pickle
import time
from collections.abc import Callable
from multiprocessing import shared_memory

import numpy as np
import torch

SLOTS = 4
SLOT_BYTES = 4 << 20  # a plan of a full 8k-token prefill pickles to ~40 KB


class PeerGone(RuntimeError):
    """A rank stopped answering while a message waited for it."""


def _wait(ready: Callable[[], bool], alive: Callable[[], bool], what: str) -> None:
    spins = 0
    while not ready():
        spins += 1
        if spins < 2000:
            continue
        if spins % 64 == 0 and not alive():
            raise PeerGone(f"a tensor-parallel rank is gone while {what}")
        time.sleep(min(0.002, 1e-5 * (spins - 2000) / 64 + 1e-5))


class ShmRing:
    """One writer, ``readers`` readers over a named shared-memory block (``name``: None creates it)."""

    def __init__(self, readers: int, name: str | None = None, reader: int | None = None) -> None:
        header = (2 * SLOTS + readers) * 8
        create = name is None
        self.shm = shared_memory.SharedMemory(name=name, create=create, size=header + SLOTS * SLOT_BYTES)
        self.name, self.reader, self.readers = self.shm.name, reader, readers
        ints = np.ndarray((2 * SLOTS + readers,), dtype=np.int64, buffer=self.shm.buf)
        if create:
            ints[:] = 0
        self.written, self.lengths, self.read = ints[:SLOTS], ints[SLOTS:2 * SLOTS], ints[2 * SLOTS:]
        self.payload = np.ndarray((SLOTS, SLOT_BYTES), dtype=np.uint8, buffer=self.shm.buf, offset=header)
        self.count = 0  # messages sent (writer) or received (reader)
        self.alive: Callable[[], bool] = lambda: True

    def send(self, obj) -> None:
        data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        if len(data) > SLOT_BYTES:
            raise ValueError(f"a step plan of {len(data)} bytes exceeds the ring's {SLOT_BYTES}-byte slots; "
                             f"use plan_broadcast='torch' or a smaller max_num_batched_tokens")
        m, slot = self.count, self.count % SLOTS
        _wait(lambda: int(self.read.min()) >= m - SLOTS + 1, self.alive, "sending a step plan")
        self.payload[slot, :len(data)] = np.frombuffer(data, dtype=np.uint8)
        self.lengths[slot] = len(data)
        self.written[slot] = m + 1
        self.count += 1

    def recv(self):
        m, slot = self.count, self.count % SLOTS
        _wait(lambda: int(self.written[slot]) == m + 1, self.alive, "waiting for a step plan")
        data = self.payload[slot, :int(self.lengths[slot])].tobytes()
        self.read[self.reader] = m + 1
        self.count += 1
        return pickle.loads(data)

    def close(self, unlink: bool = False) -> None:
        # drop the numpy views of the buffer first: SharedMemory refuses to close under exported views
        self.written = self.lengths = self.read = self.payload = None
        try:
            self.shm.close()
            if unlink:
                self.shm.unlink()
        except (BufferError, FileNotFoundError):
            pass


class TorchBroadcast:
    """The plan's pickled bytes broadcast from rank 0 over ``group`` (a gloo group)."""

    def __init__(self, group, rank: int) -> None:
        self.group, self.rank = group, rank
        self.name = None
        self.alive: Callable[[], bool] = lambda: True

    def send(self, obj) -> None:
        data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        torch.distributed.broadcast(torch.tensor([len(data)], dtype=torch.int64), src=0, group=self.group)
        payload = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        torch.distributed.broadcast(payload, src=0, group=self.group)

    def recv(self):
        size = torch.empty(1, dtype=torch.int64)
        torch.distributed.broadcast(size, src=0, group=self.group)
        payload = torch.empty(int(size.item()), dtype=torch.uint8)
        torch.distributed.broadcast(payload, src=0, group=self.group)
        return pickle.loads(payload.numpy().tobytes())

    def close(self, unlink: bool = False) -> None:
        return None
