"""Graceful drain on SIGTERM: finish what runs, refuse what comes, exit once nothing is in flight.

    SIGTERM ─► Drain.begin():  new API requests ─► 503 + Retry-After  (GuardMiddleware)
                               /health, the replica report ─► "draining" (a router fails over)
               running requests go on, up to ``shutdown_timeout`` seconds
               then each one left is ended: a stream with an error event and ``[DONE]``,
               a non-streaming request with a 503 body
               nothing in flight ─► the server stops (uvicorn), the engine stops, the process exits

The middleware counts requests in flight on the API paths (a streaming response counts until its
last byte went out), so "nothing in flight" is exact, and the exit follows the last request at once.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import time
from collections.abc import Callable

import uvicorn

logger = logging.getLogger("podium_server")

RETRY_AFTER_S = 5  # what a refused client is told to wait (another replica usually takes it at once)
FINAL_GRACE_S = 2.0  # after the timeout ended the requests left, how long their responses get to go out
POLL_GRACE_S = 0.25  # once no API request is left, what status polls (a router's long poll) get to end


class Drain:
    def __init__(self, timeout: float) -> None:
        self.timeout = timeout
        self.draining = False
        self.in_flight = 0
        self.started_at: float | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._idle: asyncio.Event | None = None
        self._task: asyncio.Task | None = None

    def attach(self, loop: asyncio.AbstractEventLoop) -> None:
        """Bind to the server's event loop (the app's lifespan does this at startup)."""
        self._loop = loop
        self._idle = asyncio.Event()
        self._idle.set()

    # -- the middleware's counting ---------------------------------------------------------------
    def enter(self) -> None:
        self.in_flight += 1
        if self._idle is not None:
            self._idle.clear()

    def exit(self) -> None:
        self.in_flight -= 1
        if self.in_flight == 0 and self._idle is not None:
            self._idle.set()

    # -- the drain ----------------------------------------------------------------------------------
    def begin_threadsafe(self, end_open_requests: Callable[[str], None], stop_server: Callable[[], None]) -> bool:
        """Start draining from a signal handler (any thread); False if there is no loop to drain on."""
        if self._loop is None or self._loop.is_closed():
            return False
        self._loop.call_soon_threadsafe(self.begin, end_open_requests, stop_server)
        return True

    def begin(self, end_open_requests: Callable[[str], None], stop_server: Callable[[], None]) -> None:
        if self.draining:
            return
        self.draining, self.started_at = True, time.monotonic()
        logger.info("draining: %d requests in flight get up to %.0f s to finish; new requests get 503",
                    self.in_flight, self.timeout)
        self._task = asyncio.ensure_future(self._run(end_open_requests, stop_server))

    async def _run(self, end_open_requests: Callable[[str], None], stop_server: Callable[[], None]) -> None:
        if not await self._wait_idle(self.timeout):
            logger.warning("drain: %d requests still running after %.0f s; ending them", self.in_flight, self.timeout)
            end_open_requests(f"the server is shutting down: requests still running {self.timeout:g} s after "
                              "SIGTERM were ended; retry on another replica")
            if not await self._wait_idle(FINAL_GRACE_S):
                logger.warning("drain: %d responses did not end in %.0f s; stopping anyway", self.in_flight,
                               FINAL_GRACE_S)
        logger.info("drain complete after %.1f s; stopping", time.monotonic() - self.started_at)
        stop_server()

    async def _wait_idle(self, timeout: float) -> bool:
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
            return True
        except asyncio.TimeoutError:
            return False


class DrainingServer(uvicorn.Server):
    """uvicorn whose first SIGTERM drains the app before the usual shutdown: ``on_sigterm(stop)``
    starts the drain and returns True (it calls ``stop`` when done), or returns False (nothing to
    drain: uvicorn stops as usual). A second SIGTERM, or Ctrl-C, is uvicorn's own shutdown."""

    def __init__(self, config: uvicorn.Config, on_sigterm: Callable[[Callable[[], None]], bool]) -> None:
        super().__init__(config)
        self._on_sigterm, self._drain_started = on_sigterm, False

    def handle_exit(self, sig, frame) -> None:
        if sig != signal.SIGTERM or self._drain_started or self.should_exit:
            super().handle_exit(sig, frame)
            return
        self._drain_started = True
        if hasattr(self, "_captured_signals"):  # uvicorn re-raises the signals it caught once stopped
            self._captured_signals.append(sig)
        if not self._on_sigterm(self._stop):
            super().handle_exit(sig, frame)

    def _stop(self) -> None:
        # every API request has ended; what is left are status polls (a router's KV-event long
        # poll, up to 30 s): they are cut short, not given the whole shutdown timeout again
        timeout = self.config.timeout_graceful_shutdown
        self.config.timeout_graceful_shutdown = POLL_GRACE_S if timeout is None else min(timeout, POLL_GRACE_S)
        self.should_exit = True
