"""The tensor-parallel worker processes and rank 0's handle on them.

``start_workers`` (in the engine's process, rank 0) checks the split, creates the plan channel,
spawns ranks 1..n-1 (``spawn``: a fresh interpreter, no forked device state) and joins the group
with them. Each worker builds its ``ModelShard`` exactly as the engine does, then loops: receive a
plan, take the previous step's tokens where the plan has placeholders, ``runner.execute`` it (the
collectives inside keep the ranks in step; only rank 0 samples). ``None`` stops it.

A thread in rank 0 watches the workers' process sentinels: a worker that exits marks the group
dead at once, and the engine's next step (or the collective it is blocked in, which gloo fails
when the peer's connection closes) raises ``EngineDead``. Each worker also beats: a thread of its
own stamps the time into a shared array every ``HEARTBEAT_S``; a worker whose stamp is older than
``HEARTBEAT_TIMEOUT_S`` is a hung process (stopped, swapped out, frozen by its driver with the
interpreter held) and rank 0 stops the workers, with the same result, within seconds and whether or
not a step is running. A step that waits more than ``STEP_TIMEOUT_S`` for the others (a rank that
still beats but never reaches the collective) does the same. A worker whose rank 0 is gone stops
(its channel wait checks its parent; its collectives fail).
"""

from __future__ import annotations

import atexit
import logging
import multiprocessing as mp
import os
import queue
import threading
import time
import traceback
from contextlib import contextmanager
from multiprocessing.connection import wait

import torch

from ..errors import EngineDead
from .channel import ShmRing
from .group import TensorParallelGroup, free_port
from .sharding import check_split

logger = logging.getLogger(__name__)

JOIN_TIMEOUT_S = 10
# a step that waits longer than this for the other ranks means one of them hangs (stopped, stuck in
# a driver call): rank 0 stops the workers, which fails the blocked collective, and the engine is
# dead with that reason. Far above any step's time on a device that serves (steps take milliseconds)
STEP_TIMEOUT_S = 60.0
HEARTBEAT_S = 0.5
# a live worker's beat thread runs every HEARTBEAT_S even while its main thread computes (torch
# releases the interpreter) or loads weights; 10 s leaves room for a machine far busier than that
HEARTBEAT_TIMEOUT_S = 10.0


def _check_devices(platform, world_size: int) -> None:
    count = platform.device_count()
    for rank in range(world_size):
        index = platform.rank_device(rank, world_size)
        if not 0 <= index < count:
            raise ValueError(f"tensor_parallel_size={world_size} needs a device for each rank, but platform "
                             f"{platform.name!r} has {count} device(s) here (rank {rank} asks for device {index}); "
                             f"use tensor_parallel_size <= {count}")


class Workers:
    """Rank 0's group plus the worker processes it started."""

    def __init__(self, group: TensorParallelGroup, procs: list, reports, beats) -> None:
        self.group, self.procs, self.reports, self.beats = group, procs, reports, beats
        self.dead: str | None = None
        self._step_started: float | None = None
        self._stop = threading.Event()
        self._monitor = threading.Thread(target=self._watch, name="podium-tp-monitor", daemon=True)
        self._monitor.start()
        channel = group.channel
        channel.alive = lambda: self.dead is None

    # the engine's side of a step ------------------------------------------------------------
    def __getattr__(self, name):  # shard(), connect(), kv_heads(), smallest(), rank, world_size
        return getattr(self.group, name)

    def _watch(self) -> None:
        sentinels = {p.sentinel: p for p in self.procs}
        while not self._stop.is_set() and sentinels:
            for ready in wait(list(sentinels), timeout=0.5):
                proc = sentinels.pop(ready)
                if not self._stop.is_set() and self.dead is None:
                    self.dead = f"tensor-parallel worker {proc.name} (pid {proc.pid}) exited with code {proc.exitcode}"
                    logger.error("%s; the engine cannot run any more steps", self.dead)
            if self.dead is None and not self._stop.is_set():
                self._check_hung()

    def _check_hung(self) -> None:
        now = time.monotonic()
        started = self._step_started
        if started is not None and now - started > STEP_TIMEOUT_S:
            reason = (f"a step waited more than {STEP_TIMEOUT_S:g} s for the other tensor-parallel ranks "
                      f"(one hangs)")
        else:
            silent = [(rank, now - self.beats[rank]) for rank in range(1, len(self.beats))
                      if now - self.beats[rank] > HEARTBEAT_TIMEOUT_S]
            if not silent:
                return
            rank, seconds = silent[0]
            reason = f"tensor-parallel rank {rank} has not answered for {seconds:.0f} s (one hangs)"
        self.dead = f"{reason}; the workers were stopped"
        logger.error("%s", self.dead)
        for proc in self.procs:
            proc.kill()

    def check(self) -> None:
        if self.dead is not None:
            raise EngineDead(f"{self.dead}{self._worker_errors()}; restart the engine")

    def _exited(self, wait_s: float) -> str | None:
        """Which worker has exited (a collective fails as its connection closes, maybe before the
        monitor saw the process end: give it ``wait_s``), or None."""
        deadline = time.monotonic() + wait_s
        while True:
            for proc in self.procs:
                if proc.exitcode is not None:
                    return f"tensor-parallel worker {proc.name} (pid {proc.pid}) exited with code {proc.exitcode}"
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.05)

    def _worker_errors(self) -> str:
        found = []
        while True:
            try:
                rank, kind, text = self.reports.get_nowait()
            except Exception:  # noqa: BLE001 -- queue.Empty, or a queue whose writer died mid-message
                break
            if kind == "error":
                found.append(f"rank {rank}: {text.splitlines()[0] if text else ''}")
        return f" ({'; '.join(found)})" if found else ""

    @contextmanager
    def guard(self):
        """Raise EngineDead for any failure of a step's collectives (a rank died or hung)."""
        self.check()
        self._step_started = time.monotonic()
        try:
            yield
        except EngineDead:
            raise
        except Exception as exc:
            self.dead = self.dead or self._exited(wait_s=1.0) or \
                f"a tensor-parallel collective failed ({type(exc).__name__}: {exc})"
            raise EngineDead(f"{self.dead}{self._worker_errors()}; restart the engine") from exc
        finally:
            self._step_started = None

    def send_step(self, plan, feed_tokens: torch.Tensor | None) -> None:
        """Send ``plan`` to every worker and, where it has placeholders, the previous step's tokens."""
        self.group.channel.send(plan)
        if plan.fill is not None:
            self.group.feed(feed_tokens)

    def shutdown(self) -> None:
        if self._stop.is_set():
            return
        atexit.unregister(self.shutdown)
        self._stop.set()
        if self.dead is None:
            try:
                self.group.channel.send(None)
            except Exception:  # noqa: BLE001 -- stopping anyway
                pass
        for proc in self.procs:
            proc.join(timeout=JOIN_TIMEOUT_S)
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=JOIN_TIMEOUT_S)
        self.group.close()


def start_workers(config, platform, hf_config) -> Workers:
    """Spawn ranks 1..n-1 for ``config`` and join the group as rank 0 (ValueError for an impossible split)."""
    world = config.tensor_parallel_size
    check_split(hf_config, world)
    _check_devices(platform, world)
    port = free_port()
    ring = ShmRing(world - 1) if config.plan_broadcast == "shm" else None
    ctx = mp.get_context("spawn")
    reports = ctx.Queue()
    beats = ctx.RawArray("d", [time.monotonic()] * world)  # each worker's last heartbeat (index = rank)
    procs = []
    try:
        for rank in range(1, world):
            proc = ctx.Process(target=worker_main, name=f"podium-tp-rank{rank}", daemon=True,
                               args=(config, rank, port, ring.name if ring else None, os.getpid(), reports, beats))
            proc.start()
            procs.append(proc)
        _wait_until_joining(procs, reports)
        group = TensorParallelGroup(platform, 0, world, port, config.plan_broadcast, ring,
                                    batch_invariant=config.batch_invariant)
    except BaseException:
        for proc in procs:
            proc.kill()
        if ring is not None:
            ring.close(unlink=True)
        raise
    workers = Workers(group, procs, reports, beats)
    atexit.register(workers.shutdown)
    return workers


def _wait_until_joining(procs: list, reports) -> None:
    """Wait until every worker has started its platform and is joining the group; a worker that
    fails first (an import, its platform, its device) is a RuntimeError with its reason."""
    joining: set[int] = set()
    while len(joining) < len(procs):
        try:
            rank, kind, text = reports.get(timeout=0.5)
        except queue.Empty:
            for rank, proc in enumerate(procs, start=1):
                if rank not in joining and not proc.is_alive():
                    raise RuntimeError(f"tensor-parallel rank {rank} exited with code {proc.exitcode} while "
                                       f"starting") from None
            continue
        if kind == "error":
            raise RuntimeError(f"tensor-parallel rank {rank} failed to start: {text}")
        joining.add(rank)


def _beat(beats, rank: int) -> None:
    while True:
        beats[rank] = time.monotonic()  # CLOCK_MONOTONIC: one clock for every process of the machine
        time.sleep(HEARTBEAT_S)


def worker_main(config, rank: int, port: int, ring_name: str | None, parent: int, reports, beats) -> None:
    """A worker rank: build the shard, then run plans until told to stop or rank 0 is gone."""
    from ..engine import grad_off
    from ..loader import resolve_model
    from ..platform_setup import start_platform
    from ..shard import ModelShard

    threading.Thread(target=_beat, args=(beats, rank), name="podium-tp-heartbeat", daemon=True).start()
    group = None
    try:
        started = start_platform(config, rank=rank)  # binds this rank's device only
        platform = started.platform
        config = config.with_defaults(platform.config_defaults())
        reports.put((rank, "joining", ""))
        group = TensorParallelGroup(platform, rank, config.tensor_parallel_size, port, config.plan_broadcast,
                                    ring_name, batch_invariant=config.batch_invariant)
        group.channel.alive = lambda: os.getppid() == parent
        source = resolve_model(config.model, tokenizer_cache=config.tokenizer_cache, load_tokenizer=False)
        max_model_len = config.max_model_len or source.max_model_len
        off = grad_off(platform)
        shard = ModelShard(config, started, source, max_model_len, off, group=group)
        shard.capture_graphs()
        _serve(group, shard, off)
    except Exception as exc:  # noqa: BLE001 -- reported, then the process exits non-zero
        reports.put((rank, "error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc(limit=8)}"))
        logger.error("tensor-parallel rank %d failed: %s", rank, exc)
        raise SystemExit(1) from None
    finally:
        if group is not None:
            group.close()


def _serve(group: TensorParallelGroup, shard, no_grad) -> None:
    runner, device = shard.runner, shard.device
    prev_samples = 0
    while True:
        plan = group.channel.recv()
        if plan is None:
            return
        with no_grad():
            feed = None
            if plan.fill is not None:
                feed = group.feed(torch.empty(prev_samples, dtype=torch.long, device=device))
            runner.execute(plan, feed)
        prev_samples = len(plan.samples)
