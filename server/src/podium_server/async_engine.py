"""The engine behind the server: model steps run on a dedicated thread, never on the event loop.

    event loop (HTTP handlers)                         engine thread (owns the LLMEngine)
    add() / release() ──► commands (queue.SimpleQueue) ──► engine.add_request / abort_request
                                                           while there is work: engine.step()
    RequestStream.put ◄── loop.call_soon_threadsafe ◄──── one callback per step, all its outputs

Invariants: only the engine thread touches the engine; only the event loop touches the streams.
Outputs are cumulative (all text and token ids so far), so a stream keeps only the newest one: a
slow reader skips intermediate outputs without losing anything. A request whose reader goes away
is aborted at once (its blocks are freed by the next command the thread reads). If a step raises,
the thread stops, every open request fails and ``alive`` turns false (``/health`` answers 503).
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, Protocol

from podium.outputs import RequestOutput
from podium.sampling_params import SamplingParams

logger = logging.getLogger("podium_server")
_IDLE_WAIT_S = 0.005  # when a step made no progress, wait this long for a command before stepping again


class EngineDeadError(RuntimeError):
    """The engine thread stopped (a step raised, or the server is shutting down)."""


class OutputListener(Protocol):
    def on_output(self, stream: RequestStream, output: RequestOutput, new_tokens: int) -> None: ...
    def on_abort(self, stream: RequestStream) -> None: ...


@dataclass
class _Add:
    request_id: str
    prompt: list[int]
    params: SamplingParams


@dataclass
class _Abort:
    request_id: str


class _Stop:
    pass


class RequestStream:
    """The event loop's end of one request: the newest output, plus timing for metrics."""

    def __init__(self, request_id: str, num_prompt_tokens: int) -> None:
        self.request_id = request_id
        self.num_prompt_tokens = num_prompt_tokens
        self.arrival_time = time.monotonic()
        self.first_token_time: float | None = None
        self.last_token_time: float | None = None
        self.num_generated = 0  # over all samples
        self.finished = False  # the final output arrived, or the request was aborted
        self._latest: RequestOutput | None = None
        self._error: BaseException | None = None
        self._event = asyncio.Event()

    def put(self, output: RequestOutput, now: float) -> int:
        """Keep the newest output; returns how many tokens it adds over the previous one."""
        total = sum(len(c.token_ids) for c in output.outputs)
        new_tokens, self.num_generated = total - self.num_generated, total
        if new_tokens > 0:
            self.first_token_time = self.first_token_time or now
            self.last_token_time = now
        self.finished = output.finished
        self._latest = output
        self._event.set()
        return new_tokens

    def fail(self, error: BaseException) -> None:
        self.finished = True
        self._error = error
        self._event.set()

    async def outputs(self) -> AsyncIterator[RequestOutput]:
        """Each newest output until the final one (``output.finished``)."""
        while True:
            await self._event.wait()
            self._event.clear()
            output, self._latest = self._latest, None
            if output is not None:
                yield output
                if output.finished:
                    return
            elif self._error is not None:
                raise self._error

    async def final(self) -> RequestOutput:
        last = None
        async for output in self.outputs():
            last = output
        return last


class AsyncEngine:
    """Owns the engine thread; ``add`` / ``release`` are called from the event loop only."""

    def __init__(self, engine: Any, listener: OutputListener | None = None) -> None:
        self.engine = engine
        self._listener = listener
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, RequestStream] = {}
        self._pending: dict[str, asyncio.Future] = {}  # adds the thread has not answered yet
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self.stats = engine.stats()  # the newest snapshot, replaced by the engine thread

    # -- lifecycle (event loop) ---------------------------------------------------------------
    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="podium-engine", daemon=True)
        self._thread.start()

    async def stop(self) -> None:
        """Abort whatever is still running and join the thread (in-flight HTTP requests are done by now)."""
        if self._thread is None:
            return
        self._commands.put(_Stop())
        await asyncio.to_thread(self._thread.join)
        self._fail_all(EngineDeadError("the server is shutting down"))

    @property
    def alive(self) -> bool:
        return self._error is None and self._thread is not None and self._thread.is_alive()

    @property
    def num_open_requests(self) -> int:
        return len(self._streams)

    # -- requests (event loop) ----------------------------------------------------------------
    async def add(self, request_id: str, prompt: list[int], params: SamplingParams) -> RequestStream:
        """Queue a request and wait until the engine took it; the engine's ValueError comes back here."""
        if not self.alive:
            raise EngineDeadError(f"the engine is not running ({self._error or 'stopped'})")
        if request_id in self._streams or request_id in self._pending:
            raise ValueError(f"request id {request_id!r} is already in use")
        stream = RequestStream(request_id, len(prompt))
        accepted = self._loop.create_future()
        self._pending[request_id] = accepted
        self._streams[request_id] = stream
        self._commands.put(_Add(request_id, prompt, params))
        try:
            await accepted
        except BaseException:
            self._streams.pop(request_id, None)
            self._pending.pop(request_id, None)
            if self._error is None:
                self._commands.put(_Abort(request_id))  # harmless if the engine never took it
            raise
        return stream

    def release(self, stream: RequestStream) -> None:
        """Call when done reading a stream: aborts the request if it has not finished."""
        if stream.finished:
            return
        stream.finished = True
        self._streams.pop(stream.request_id, None)
        self._commands.put(_Abort(stream.request_id))
        if self._listener is not None:
            self._listener.on_abort(stream)

    # -- delivery (event loop, scheduled by the thread) ---------------------------------------
    def _deliver(self, outputs: list[RequestOutput]) -> None:
        now = time.monotonic()
        for output in outputs:
            stream = self._streams.get(output.request_id)
            if stream is None:
                continue  # released while this step ran
            new_tokens = stream.put(output, now)
            if self._listener is not None:
                self._listener.on_output(stream, output, new_tokens)
            if output.finished:
                del self._streams[output.request_id]

    def _answer(self, request_id: str, error: BaseException | None) -> None:
        accepted = self._pending.pop(request_id, None)
        if accepted is None or accepted.done():
            return
        if error is None:
            accepted.set_result(None)
        else:
            accepted.set_exception(error)

    def _fail_all(self, error: BaseException) -> None:
        self._error = self._error or error
        for rid in list(self._pending):
            self._answer(rid, EngineDeadError(str(error)))
        for stream in self._streams.values():
            stream.fail(EngineDeadError(str(error)))
        self._streams.clear()

    def _post(self, fn: Callable, *args: Any) -> None:
        try:
            self._loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the loop is closed: nobody is listening any more
            pass

    # -- the engine thread --------------------------------------------------------------------
    def _run(self) -> None:
        active: set[str] = set()
        try:
            while True:
                if not self.engine.has_unfinished_requests():
                    self.stats = self.engine.stats()
                    if not self._apply(self._commands.get(), active):
                        break
                if not self._drain(active):
                    break
                if self.engine.has_unfinished_requests() and not self._step(active):
                    break
        except BaseException as exc:  # a failed step: report it to everyone, stop serving
            logger.exception("the engine loop died")
            self._post(self._fail_all, EngineDeadError(f"the engine loop died: {type(exc).__name__}: {exc}"))
            return
        if active:
            self.engine.abort_request(sorted(active))
        self.stats = self.engine.stats()

    def _drain(self, active: set[str], timeout: float | None = None) -> bool:
        """Apply every queued command (waiting up to ``timeout`` for the first); False on stop."""
        try:
            command = self._commands.get(timeout=timeout) if timeout else self._commands.get_nowait()
        except queue.Empty:
            return True
        while True:
            if not self._apply(command, active):
                return False
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return True

    def _apply(self, command: Any, active: set[str]) -> bool:
        if isinstance(command, _Add):
            try:
                self.engine.add_request(command.request_id, command.prompt, command.params)
            except Exception as exc:  # a bad request is that request's problem, never the loop's
                self._post(self._answer, command.request_id, exc)
            else:
                active.add(command.request_id)
                self._post(self._answer, command.request_id, None)
        elif isinstance(command, _Abort):
            if command.request_id in active:
                active.discard(command.request_id)
                self.engine.abort_request(command.request_id)
                self.stats = self.engine.stats()
        elif isinstance(command, _Stop):
            return False
        return True

    def _step(self, active: set[str]) -> bool:
        """One engine step and its delivery; False if a stop command arrived while idling."""
        started = time.perf_counter()
        outputs = self.engine.step()
        for output in outputs:
            if output.finished:
                active.discard(output.request_id)
        self.stats = self.engine.stats()
        if outputs:
            self._post(self._deliver, outputs)
        elif time.perf_counter() - started < 1e-3:  # nothing could be scheduled: don't spin
            return self._drain(active, timeout=_IDLE_WAIT_S)
        return True
