"""``podium fleet up FILE``: each replica of a fleet file as a Ray actor, the router in front.

A fleet file (TOML)::

    [ray]                       # optional: a cluster's address ("auto" for the one `ray start` made);
    address = "auto"            # none: a local Ray instance (num_cpus, object_store_memory for it)

    [[replica]]
    name = "h200"               # replicas = N makes h200-0 .. h200-(N-1)
    model = "meta-llama/Llama-3.1-8B-Instruct"
    platform = "cuda"           # podium serve --device
    num_gpus = 1                # Ray resources: num_cpus, num_gpus, resources = { TPU = 4 }
    args = ["--max-num-seqs", "128"]   # more podium serve options (engine options)
    env = { OMP_NUM_THREADS = "8" }

Each actor (``ReplicaServer``) runs ``podium serve`` on its node, on a free port, as a child that
dies with it, and exits when that child does; Ray places it on a node with the resources and
restarts it when it dies (``max_restarts``, default: always). The router's side (``FleetFeed``)
asks every actor for its URL every poll interval and keeps the router's replica set equal to the
answers: an actor that does not answer is drained; a restarted one comes back under its new URL.
The router itself never imports the core or the server: it only starts the ``podium`` command.
"""

from __future__ import annotations

import asyncio
import logging
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path

from .settings import ReplicaSpec, RouterSettings, tomllib

logger = logging.getLogger("podium_router")
_RESOURCE_KEYS = ("num_cpus", "num_gpus", "memory")
# how long an actor may take to answer info() before its replica leaves the set: generous, since a
# dead actor answers at once (with an error) and the router's health checks take a silent replica
# out of routing anyway; a short one made replicas flap in and out on a loaded machine
PATIENCE_S = 30.0
_REPLICA_KEYS = {"name", "model", "platform", "args", "env", "replicas", "resources", "max_restarts",
                 "startup_timeout", *_RESOURCE_KEYS}


@dataclass(frozen=True)
class ReplicaPlan:
    name: str
    model: str
    platform: str | None = None
    args: tuple[str, ...] = ()
    env: dict = field(default_factory=dict)
    num_cpus: float = 1.0
    num_gpus: float = 0.0
    memory: float | None = None
    resources: dict = field(default_factory=dict)
    max_restarts: int = -1
    startup_timeout: float = 900.0

    def serve_command(self, host: str, port: int) -> list[str]:
        podium = shutil.which("podium") or str(Path(sys.executable).parent / "podium")
        command = [podium, "serve", self.model, "--host", host, "--port", str(port)]
        if self.platform:
            command += ["--device", self.platform]
        return command + list(self.args)

    def actor_options(self) -> dict:
        options = {"max_restarts": self.max_restarts, "max_task_retries": 0,
                   "num_cpus": self.num_cpus, "num_gpus": self.num_gpus}
        if self.memory:
            options["memory"] = self.memory
        if self.resources:
            options["resources"] = dict(self.resources)
        return options


@dataclass(frozen=True)
class FleetSpec:
    replicas: tuple[ReplicaPlan, ...]
    address: str | None = None
    num_cpus: int | None = None  # of a local Ray instance
    object_store_memory: int = 200 * 2**20

    @classmethod
    def read(cls, path: Path) -> FleetSpec:
        try:
            doc = tomllib.loads(Path(path).read_text())
        except (OSError, tomllib.TOMLDecodeError) as exc:
            raise ValueError(f"fleet file {path}: {exc}") from None
        return cls.parse(doc, str(path))

    @classmethod
    def parse(cls, doc: dict, where: str = "fleet file") -> FleetSpec:
        entries = doc.get("replica")
        if not isinstance(entries, list) or not entries:
            raise ValueError(f"{where}: name at least one replica as [[replica]] with model = ...")
        plans = []
        for i, entry in enumerate(entries):
            unknown = sorted(set(entry) - _REPLICA_KEYS)
            if unknown:
                raise ValueError(f"{where}: replica {i}: unknown keys {unknown}; known: {sorted(_REPLICA_KEYS)}")
            if "model" not in entry:
                raise ValueError(f"{where}: replica {i} names no model")
            count = int(entry.get("replicas", 1))
            base = {k: v for k, v in entry.items() if k != "replicas"}
            base["args"] = tuple(str(a) for a in entry.get("args", ()))
            name = str(entry.get("name", f"replica{i}"))
            for k in range(count):
                plans.append(ReplicaPlan(**{**base, "name": name if count == 1 else f"{name}-{k}"}))
        names = [p.name for p in plans]
        if len(set(names)) != len(names):
            raise ValueError(f"{where}: replica names must be unique, got {names}")
        ray_opts = doc.get("ray", {})
        return cls(tuple(plans), ray_opts.get("address"), ray_opts.get("num_cpus"),
                   int(ray_opts.get("object_store_memory", cls.object_store_memory)))


class ReplicaServer:
    """The Ray actor's body: one ``podium serve`` child on this node (see the module docstring)."""

    def __init__(self, plan: ReplicaPlan) -> None:
        host = _node_ip()
        port = _free_port()
        env = {**os.environ, **{k: str(v) for k, v in plan.env.items()}}
        self.url = f"http://{host}:{port}"
        self.name = plan.name
        self.process = subprocess.Popen(plan.serve_command(host, port), env=env, preexec_fn=_die_with_parent)
        self._wait_healthy(plan.startup_timeout)
        threading.Thread(target=self._exit_with_child, daemon=True).start()

    def info(self) -> dict:
        return {"name": self.name, "url": self.url, "pid": os.getpid(), "server_pid": self.process.pid}

    def _wait_healthy(self, timeout: float) -> None:
        import httpx

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"podium serve for {self.name} exited with code {self.process.returncode}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        self.process.kill()
        raise RuntimeError(f"podium serve for {self.name} was not healthy within {timeout:.0f} s")

    def _exit_with_child(self) -> None:
        code = self.process.wait()
        logger.error("podium serve for %s exited with code %s; the actor exits so Ray restarts it", self.name, code)
        os._exit(1)


class FleetFeed:
    """Starts the actors and keeps the router's ``fleet`` replicas equal to their current URLs."""

    def __init__(self, spec: FleetSpec, ray_module) -> None:
        self.spec, self.ray = spec, ray_module
        actor_class = ray_module.remote(ReplicaServer)
        self.actors = {plan.name: actor_class.options(**plan.actor_options()).remote(plan) for plan in spec.replicas}
        self._asks: dict[str, tuple[Future, float]] = {}  # one question in flight per actor
        self._last: dict[str, dict | None] = {}

    async def run(self, pool) -> None:
        while True:
            # Ray's calls may block (an actor restarting): on a thread, never on the router's event loop
            answers = await asyncio.to_thread(lambda: [self._answer(name, PATIENCE_S) for name in self.actors])
            pool.sync([ReplicaSpec(a["url"], a["name"]) for a in answers if a is not None], "fleet")
            await asyncio.sleep(pool.settings.poll_interval_s)

    def _answer(self, name: str, patience_s: float) -> dict | None:
        """The actor's answer to ``info()``: its newest, asked again each time it came; None while
        it is starting, restarting or dead, or has not answered for ``patience_s`` (not in routing)."""
        now = time.monotonic()
        ask, asked_at = self._asks.get(name, (None, now))
        if ask is None or ask.done():
            if ask is not None:
                ok = not ask.cancelled() and ask.exception() is None
                self._last[name] = ask.result() if ok else None
            self._asks[name] = (self.actors[name].info.remote().future(), now)
        elif now - asked_at > patience_s:
            self._last[name] = None
        return self._last.get(name)

    def stop(self) -> None:
        for actor in self.actors.values():
            self.ray.kill(actor, no_restart=True)


def run_fleet_up(spec: FleetSpec, settings: RouterSettings, address: str | None = None) -> int:
    try:
        import ray
    except ImportError:
        raise RuntimeError("podium fleet needs Ray: pip install 'podium-router[ray]'") from None
    address = address or spec.address
    if address:
        ray.init(address=address, log_to_driver=False)
    else:
        ray.init(num_cpus=spec.num_cpus, object_store_memory=spec.object_store_memory, include_dashboard=False,
                 log_to_driver=False)
    feed = None
    try:
        feed = FleetFeed(spec, ray)
        from .cli import serve

        print(f"podium fleet: {len(spec.replicas)} replica actor(s) on Ray "
              f"({'cluster ' + address if address else 'a local instance'})", flush=True)
        serve(settings, on_start=feed.run)
    finally:
        if feed is not None:
            feed.stop()
        ray.shutdown()
    return 0


def _node_ip() -> str:
    try:
        import ray

        return ray.util.get_node_ip_address()
    except Exception:
        return "127.0.0.1"


def _free_port() -> int:
    """A port nothing is bound to now, for a replica's server, below the kernel's ephemeral range (Linux:
    ``ip_local_port_range``): a port from bind(0) is one an outgoing connection may take before the replica
    binds it, and a tensor-parallel replica's ranks connect to each other while its server starts. (The
    core's ``podium.parallel.group.free_port`` picks the same way for localhost; the router never imports
    the core, and its replicas may listen on every interface.)"""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            high = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        high = 32768
    chooser = random.Random()
    for _ in range(500):
        port = chooser.randrange(max(1024, high - 12000), high)
        with socket.socket() as s:
            try:
                s.bind(("", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def _die_with_parent() -> None:
    """In the child, before exec: SIGKILL it when the actor process dies (Linux)."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass
