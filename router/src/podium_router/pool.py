"""The router's replica set and how it learns about each replica.

Per replica, two tasks on the event loop:

    checks     every poll_interval_s: GET /podium/v1/replica (a Podium replica: report, load,
               prefill counters), else GET /health (any OpenAI server). ``unhealthy_after`` failures
               in a row, or one refused connection from a proxied request, take it out of routing;
               the next passing check brings it back.
    KV events  (Podium replicas under a known hash scheme) a long poll of /podium/v1/kv_events that
               keeps ``replica.cached`` equal to the replica's prefix cache; a gap (a restart,
               events dropped) gets a reset snapshot from the replica.

Removing a replica drains it: no new requests; it leaves the set when its last one finishes.
"""

from __future__ import annotations

import asyncio
import logging

import httpx

from .replica import DRAINING, HEALTHY, UNHEALTHY, Replica
from .settings import ReplicaSpec, RouterSettings

logger = logging.getLogger("podium_router")
KV_POLL_S = 10.0  # the long poll's wait at the replica
# A check that gets no answer within this fails. Long enough that a replica (or the router itself)
# stalled by a busy host is not judged dead: a dead one refuses the connection at once anyway,
# and a hung one is still out of routing after two checks.
CHECK_TIMEOUT_S = 5.0


class ReplicaPool:
    def __init__(self, settings: RouterSettings, client: httpx.AsyncClient) -> None:
        self.settings = settings
        self.client = client
        self.replicas: list[Replica] = []
        self._tasks: dict[int, list[asyncio.Task]] = {}
        self._headers = {"Authorization": f"Bearer {settings.replica_api_key}"} if settings.replica_api_key else {}

    # -- membership ---------------------------------------------------------------------------------
    def add(self, spec: ReplicaSpec, source: str = "static") -> Replica:
        """Add a replica (or return the one with that URL, undrained)."""
        existing = self.find(spec.url)
        if existing is not None:
            if existing.state == DRAINING:
                self._set_state(existing, UNHEALTHY)
            return existing
        replica = Replica(spec.url, spec.name, source)
        self.replicas.append(replica)
        self._tasks[replica.id] = [asyncio.ensure_future(self._checks(replica)),
                                   asyncio.ensure_future(self._kv_events(replica))]
        logger.info("replica %s added (%s)", replica.name, source)
        return replica

    def remove(self, url: str) -> Replica | None:
        """Drain the replica at ``url``: no new requests; it goes when its last one finishes."""
        replica = self.find(url)
        if replica is not None:
            self._set_state(replica, DRAINING)
            self._maybe_drop(replica)
        return replica

    def find(self, url_or_name: str) -> Replica | None:
        url = url_or_name.rstrip("/")
        return next((r for r in self.replicas if r.url == url or r.name == url_or_name), None)

    def sync(self, specs: list[ReplicaSpec], source: str) -> None:
        """Make the replicas from ``source`` exactly ``specs`` (a reread file, a fleet's actors)."""
        wanted = {s.url.rstrip("/") for s in specs}
        for replica in [r for r in self.replicas if r.source == source and r.url not in wanted]:
            self.remove(replica.url)
        for spec in specs:
            self.add(spec, source)

    def finished(self, replica: Replica) -> None:
        """A request routed to ``replica`` ended (called by the proxy)."""
        self._maybe_drop(replica)

    def suspect(self, replica: Replica, reason: str) -> None:
        """A proxied request could not reach ``replica``: out of routing until a check passes."""
        if replica.state == HEALTHY:
            logger.warning("replica %s failed a request (%s); out of routing until it passes a check",
                           replica.name, reason)
            self._set_state(replica, UNHEALTHY)
            replica.forget_server()

    async def close(self) -> None:
        tasks = [t for ts in self._tasks.values() for t in ts]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._tasks.clear()

    def _maybe_drop(self, replica: Replica) -> None:
        if replica.state == DRAINING and replica.in_flight == 0 and replica in self.replicas:
            self.replicas.remove(replica)
            for task in self._tasks.pop(replica.id, []):
                task.cancel()
            logger.info("replica %s removed", replica.name)

    @staticmethod
    def _set_state(replica: Replica, state: str) -> None:
        replica.state = state

    # -- checks -------------------------------------------------------------------------------------
    async def _checks(self, replica: Replica) -> None:
        while True:
            ok = await self._check(replica)
            if replica.state != DRAINING:
                self._after_check(replica, ok)
            await asyncio.sleep(self.settings.poll_interval_s)

    def _after_check(self, replica: Replica, ok: bool) -> None:
        if ok:
            replica.failures = 0
            if replica.state != HEALTHY:
                logger.info("replica %s is healthy (%s)", replica.name,
                            replica.report.get("platform") if replica.is_podium else "not Podium")
                self._set_state(replica, HEALTHY)
            return
        replica.failures += 1
        if replica.failures >= self.settings.unhealthy_after and replica.state == HEALTHY:
            logger.warning("replica %s failed %d checks; out of routing", replica.name, replica.failures)
            self._set_state(replica, UNHEALTHY)
            replica.forget_server()

    async def _check(self, replica: Replica) -> bool:
        timeout = httpx.Timeout(max(CHECK_TIMEOUT_S, 4 * self.settings.poll_interval_s))
        try:
            response = await self.client.get(f"{replica.url}/podium/v1/replica", headers=self._headers,
                                             timeout=timeout)
            if response.status_code == 200:
                report = response.json()
                replica.apply_report(report, self.settings.approx_capacity_tokens)
                return bool(report.get("alive", True))
            if response.status_code in (404, 405):  # not Podium: any OpenAI server
                health = await self.client.get(f"{replica.url}/health", headers=self._headers, timeout=timeout)
                replica.is_podium = False
                if replica.routed is None:
                    replica.apply_unreported(self.settings.approx_capacity_tokens)
                return health.status_code == 200
            return False
        except (httpx.HTTPError, ValueError):
            return False

    async def _kv_events(self, replica: Replica) -> None:
        while True:
            if replica.state != HEALTHY or not replica.exact_prefixes:
                await asyncio.sleep(self.settings.poll_interval_s)
                continue
            params = {"after": replica.kv_seq, "epoch": replica.kv_epoch or "", "timeout": KV_POLL_S}
            try:
                response = await self.client.get(f"{replica.url}/podium/v1/kv_events", params=params,
                                                 headers=self._headers, timeout=httpx.Timeout(KV_POLL_S + 10))
                if response.status_code == 200:
                    replica.apply_kv_events(response.json())
                    continue
            except (httpx.HTTPError, ValueError, KeyError):
                pass
            await asyncio.sleep(self.settings.poll_interval_s)
