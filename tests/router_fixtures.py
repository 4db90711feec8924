"""Helpers for the router's tests: real ``podium serve`` / ``podium router`` processes on 127.0.0.1,
streamed completions read chunk by chunk, and the example NPU plugin installed into a folder that
only the processes given it see (installed in the test environment it would change what every
other test discovers)."""

from __future__ import annotations

import asyncio
import json
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field

import httpx

from podium.parallel.group import free_port  # re-exported: the router tests take it from here

ROOT = pathlib.Path(__file__).resolve().parents[1]
BIN = pathlib.Path(sys.executable).parent
MODEL = "smollm2-135m-instruct"
# small batches and one thread per replica: three replicas and a router share two cores
REPLICA_ARGS = ("--dtype", "float32", "--max-num-seqs", "8", "--engine-mode", "thread", "--log-level", "warning")




def install_example_npu(target: pathlib.Path) -> pathlib.Path:
    copy = target.parent / "src-npu-plugin"
    shutil.copytree(ROOT / "examples" / "npu-plugin", copy,
                    ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"))
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "--no-compile",
                    "--target", str(target), str(copy)], check=True, capture_output=True, text=True, timeout=300)
    return target


@dataclass
class Process:
    proc: subprocess.Popen
    url: str
    log: pathlib.Path
    extra: dict = field(default_factory=dict)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=20)

    def output(self) -> str:
        return self.log.read_text(errors="replace")[-4000:] if self.log.exists() else ""


def start(args: list[str], url: str, log: pathlib.Path, env: dict | None = None) -> Process:
    environ = {**os.environ, "PODIUM_API_KEY": "", "OMP_NUM_THREADS": "1", **(env or {})}
    environ.pop("PODIUM_DEVICE", None)
    handle = log.open("w")
    proc = subprocess.Popen(args, stdout=handle, stderr=subprocess.STDOUT, env=environ)
    return Process(proc, url, log)


def start_replica(tmp: pathlib.Path, name: str, *extra: str, env: dict | None = None) -> Process:
    """``podium serve`` with ``REPLICA_ARGS``; ``extra`` options come after them (and win)."""
    port = free_port()
    return start([str(BIN / "podium"), "serve", MODEL, "--port", str(port), *REPLICA_ARGS, *extra],
                 f"http://127.0.0.1:{port}", tmp / f"{name}.log", env)


def start_router(tmp: pathlib.Path, *args: str) -> Process:
    port = free_port()
    return start([str(BIN / "podium"), "router", "--port", str(port), "--poll-interval", "0.2",
                  "--log-level", "warning", *args], f"http://127.0.0.1:{port}", tmp / "router.log")


def wait_healthy(process: Process, timeout: float = 600, path: str = "/health") -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if not process.alive():
            raise RuntimeError(f"{process.url} exited with {process.proc.returncode}:\n{process.output()}")
        try:
            if httpx.get(process.url + path, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.25)
    raise RuntimeError(f"{process.url} did not become healthy:\n{process.output()}")


def wait_for(condition, timeout: float, what: str, interval: float = 0.2):
    deadline = time.time() + timeout
    while time.time() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")


def replicas_seen_by(router: Process) -> dict[str, dict]:
    return {r["url"]: r for r in httpx.get(router.url + "/admin/replicas", timeout=30).json()["replicas"]}


@dataclass
class Streamed:
    """One streamed completion as a client saw it."""

    status: int
    replica: str | None
    raw: bytes = b""
    events: list = field(default_factory=list)

    @property
    def text(self) -> str:
        return "".join(e["choices"][0]["text"] for e in self.events if isinstance(e, dict) and e.get("choices"))

    @property
    def error(self) -> dict | None:
        return next((e["error"] for e in self.events if isinstance(e, dict) and "error" in e), None)

    @property
    def done(self) -> bool:
        return bool(self.events) and self.events[-1] == "[DONE]"


async def stream_completion(client: httpx.AsyncClient, url: str, body: dict, started: asyncio.Event | None = None,
                            headers: dict | None = None) -> Streamed:
    async with client.stream("POST", url + "/v1/completions", json={**body, "stream": True},
                             headers=headers) as response:
        result = Streamed(response.status_code, response.headers.get("x-podium-replica"))
        async for chunk in response.aiter_raw():
            result.raw += chunk
            if started is not None:
                started.set()
    for line in result.raw.decode().split("\n"):
        if line.startswith("data: "):
            data = line[len("data: "):]
            result.events.append(data if data == "[DONE]" else json.loads(data))
    return result
