"""Conformance of the distributed piece: the platform's ``Communicator`` in two real processes.

Two spawned processes find the platform by name (as the kit did), bind to ``rank_device`` (both to
device 0 where the platform has one device: the collectives are checked all the same), join over
``capabilities().distributed_backend`` and run each collective on values whose result is known
exactly: all_reduce of rank-dependent integers (float32, exact), all_gather along the last and
the first dimension, broadcast from rank 0 and from the last rank. Each process reports its first
difference; the parent raises ConformanceError naming the collective, the rank and the values.
"""

from __future__ import annotations

import os
import socket
import traceback
from collections.abc import Mapping
from typing import Any

import torch

from .report import ConformanceError

WORLD = 2
TIMEOUT_S = 120  # a spawn imports torch and the plugins: seconds on a busy 2-core host


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def expected(rank: int, world: int) -> dict[str, torch.Tensor]:
    base = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    return {
        "all_reduce": sum(base * (r + 1) for r in range(world)),
        "all_gather(dim=-1)": torch.cat([base + 10 * r for r in range(world)], dim=-1),
        "all_gather(dim=0)": torch.cat([base + 10 * r for r in range(world)], dim=0),
        "broadcast(src=0)": base + 100,
        f"broadcast(src={world - 1})": base + 100 + world - 1,
    }


def run_collectives(comm, rank: int, world: int, device: torch.device) -> dict[str, torch.Tensor]:
    base = torch.arange(6, dtype=torch.float32, device=device).reshape(2, 3)
    out = {"all_reduce": comm.all_reduce(base * (rank + 1))}
    out["all_gather(dim=-1)"] = comm.all_gather(base + 10 * rank, dim=-1)
    out["all_gather(dim=0)"] = comm.all_gather(base + 10 * rank, dim=0)
    out["broadcast(src=0)"] = comm.broadcast(base + 100 + rank, src=0)
    out[f"broadcast(src={world - 1})"] = comm.broadcast(base + 100 + rank, src=world - 1)
    return out


def _rank_main(rank: int, name: str, options: dict, port: int, results) -> None:
    try:
        from .lookup import find_platform

        platform = find_platform(name, options).platform
        index = platform.rank_device(rank, WORLD)
        index = index if index < platform.device_count() else 0  # one device: both ranks share it
        platform.set_device(index)
        backend = platform.capabilities().distributed_backend
        torch.distributed.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                             world_size=WORLD)
        try:
            comm = platform.communicator(rank, WORLD)
            got = run_collectives(comm, rank, WORLD, platform.torch_device(index))
            platform.synchronize()
        finally:
            torch.distributed.destroy_process_group()
        for what, want in expected(rank, WORLD).items():
            value = got[what].cpu() if isinstance(got[what], torch.Tensor) else got[what]
            if not isinstance(value, torch.Tensor) or value.shape != want.shape or not torch.equal(value, want):
                results.put((rank, f"{what} on rank {rank} gave {value!r}, expected {want!r}"))
                return
        results.put((rank, ""))
    except BaseException as exc:  # reported by the parent, with where it came from
        results.put((rank, f"raised {type(exc).__name__}: {exc}\n{traceback.format_exc(limit=6)}"))


def declined(platform) -> str:
    """Why the two-process check cannot run here ("" when it can): two ranks on one device work
    over gloo (host tensors) but not over a device backend such as NCCL."""
    backend = platform.capabilities().distributed_backend
    if platform.device_count() < WORLD and backend != "gloo":
        return (f"the {backend} communicator needs {WORLD} devices; platform {platform.name!r} has "
                f"{platform.device_count()} here")
    return ""


def check_communicator(name: str, options: Mapping[str, Any] | None = None) -> None:
    """Run the collectives of platform ``name``'s communicator in two processes; ConformanceError if wrong."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    env = {"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        procs = [ctx.Process(target=_rank_main, args=(r, name, dict(options or {}), port, results), daemon=True)
                 for r in range(WORLD)]
        for proc in procs:
            proc.start()
        reports = {}
        try:
            for _ in range(WORLD):
                rank, problem = results.get(timeout=TIMEOUT_S)
                reports[rank] = problem
        except Exception:
            raise ConformanceError(
                f"communicator: {WORLD} ranks of platform {name!r} did not finish their collectives within "
                f"{TIMEOUT_S} s (ranks reporting: {sorted(reports)}); a collective hangs or a rank died") from None
        finally:
            for proc in procs:
                proc.join(timeout=10)
                if proc.is_alive():
                    proc.kill()
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    problems = [f"rank {r}: {p}" for r, p in sorted(reports.items()) if p]
    if problems:
        raise ConformanceError(f"communicator of platform {name!r} over {WORLD} processes: " + "; ".join(problems))
