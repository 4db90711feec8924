"""``--engine-mode thread``: the engine loop on a thread of the server's process.

    event loop ── Add / Abort ──► queue.SimpleQueue ──► engine thread: EngineLoop(engine)
    _on_report ◄── loop.call_soon_threadsafe ◄── one Report per step

No copies and no serialization: reports hand the engine's output objects to the event loop as
they are. The price is sharing one interpreter: the engine thread's Python work (scheduling,
output processing, the model's op dispatch) and the event loop's (HTTP, JSON) take turns on the
GIL. If a step raises, the thread stops and every open request fails.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from typing import Any

from .async_engine import AsyncEngine, EngineDeadError, EngineInfo
from .engine_loop import Abort, Add, EngineLoop, Stop

logger = logging.getLogger("podium_server")


class ThreadEngine(AsyncEngine):
    """Serves ``engine`` (an ``LLMEngine``, or anything with its interface) from a thread."""

    def __init__(self, engine: Any) -> None:
        super().__init__(EngineInfo.of(engine), engine.stats())
        self.engine = engine
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    def _launch(self) -> None:
        self._thread = threading.Thread(target=self._run, name="podium-engine", daemon=True)
        self._thread.start()

    def _send(self, command: Add | Abort) -> None:
        self._inbox.put(command)

    async def _shutdown(self) -> None:
        self._inbox.put(Stop())
        await asyncio.to_thread(self._thread.join)

    def _running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def _run(self) -> None:
        try:
            EngineLoop(self.engine, self._inbox, lambda report: self._post(self._on_report, report)).run()
        except BaseException as exc:  # a failed step: report it to everyone, stop serving
            logger.exception("the engine loop died")
            self._post(self._fail_all, EngineDeadError(f"the engine loop died: {type(exc).__name__}: {exc}"))
