"""The event loop's side of the engine, whatever runs the model steps (a thread or a child process).

    HTTP handlers ── add() / release() ──► AsyncEngine ── Add / Abort ──► EngineLoop (engine_loop.py)
    RequestStream.put ◄── _on_report(Report) ◄── one report per engine step, all its outputs

``ThreadEngine`` (thread_engine.py) and ``ProcessEngine`` (process_engine.py) are the two ways to
run the ``EngineLoop``; they differ only in how commands go in and reports come back, so
everything here, and every handler, behaves the same in both modes.

Invariants: only the event loop touches the streams. The engine reports each request as deltas
(``output_kind="delta"``: only the text, token ids and logprobs new since its last report, its
stop-string holdback already applied), and a stream adds the deltas its reader has not taken yet
into one (``RequestOutput.add``): a slow reader gets fewer, larger deltas, never a lost one, and
no output is ever copied whole. A request whose reader goes away is aborted at once (its blocks
are freed by the next command the loop reads). A request the engine failed (a fault in its step)
fails alone, with ``podium.errors.RequestFailed``. If the engine dies, every open request fails with
``EngineDeadError`` and ``alive`` turns false (``/health`` answers 503); nothing waits forever.
A pooling model's request (``PoolingParams``) travels the same path: its one output, the
embedding (``PoolingRequestOutput``), is a delta that is also its final.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, Protocol

from podium.chat_template import ChatPrompt
from podium.errors import EngineDead
from podium.outputs import PoolingRequestOutput, RequestOutput
from podium.pooling_params import PoolingParams
from podium.sampling_params import SamplingParams
from podium.tenant import Tenant

from .engine_loop import Abort, Add, LoadedAdapter, LoRAUpdate, Report


class EngineDeadError(EngineDead, RuntimeError):
    """The engine stopped (a step raised, its process died, or the server is shutting down)."""


class OutputListener(Protocol):
    def on_output(self, stream: RequestStream, output: RequestOutput | PoolingRequestOutput,
                  new_tokens: int) -> None: ...
    def on_abort(self, stream: RequestStream, reason: str = "abort") -> None: ...


@dataclass(frozen=True)
class EngineInfo:
    """What the server reads from the engine once, at startup (sent over the pipe in process mode)."""

    model_name: str  # the name clients use
    model: str  # the model argument (also accepted as a name)
    max_model_len: int
    platform_name: str
    kv_capacity_tokens: int
    tokenizer: Any
    # what a router reads (replica.py): the torch device, what the platform found, the batch limits
    # and the prefix cache's block hash scheme (None: prefix caching off)
    device: str = ""
    device_description: str = ""
    device_key: str = ""  # the hardware device (Platform.device_key): equal for replicas that share it
    block_size: int = 16
    max_num_seqs: int = 0
    block_hash_scheme: str | None = None
    pooling: bool = False  # the model computes embeddings (/v1/embeddings), not text
    lora_enabled: bool = False  # the engine serves LoRA adapters (enable_lora)
    lora_adapters: tuple[LoadedAdapter, ...] = ()  # the adapters loaded at startup

    @classmethod
    def of(cls, engine: Any) -> EngineInfo:
        config, platform = engine.config, getattr(engine, "platform", None)
        adapters = tuple(LoadedAdapter.of(engine, ref) for ref in getattr(engine, "lora_adapters", list)())
        return cls(engine.model_name, getattr(config, "model", engine.model_name), engine.max_model_len,
                   engine.platform_name, engine.kv_capacity_tokens, engine.tokenizer,
                   device=str(getattr(engine, "device", "")),
                   device_description=platform.availability().reason if platform is not None else "",
                   device_key=str(getattr(engine, "device_key", "")),
                   block_size=getattr(config, "block_size", 16), max_num_seqs=getattr(config, "max_num_seqs", 0),
                   block_hash_scheme=getattr(engine, "block_hash_scheme", None),
                   pooling=bool(getattr(engine, "is_pooling", False)),
                   lora_enabled=getattr(engine, "loras", None) is not None, lora_adapters=adapters)


class RequestStream:
    """The event loop's end of one request: the deltas not read yet (added into one), plus timing."""

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        self.num_prompt_tokens = 0  # the engine's count, set when it accepts the request
        self.arrival_time = time.monotonic()
        self.first_token_time: float | None = None
        self.last_token_time: float | None = None
        self.previous_token_time: float | None = None  # the token arrival before the last one
        self.num_generated = 0  # over all samples
        self.sample_tokens: dict[int, int] = {}  # per sample index: tokens generated so far
        self.finish_reasons: dict[int, str] = {}  # per finished sample index
        self.finished = False  # the final output arrived, or the request was aborted
        self.sample_texts: dict[int, list[str]] = {}  # per sample index: its text pieces (the audit log)
        self.trace_id: str | None = None  # the HTTP request's X-Request-Id (metrics exemplars)
        self._unread: RequestOutput | PoolingRequestOutput | None = None
        self._error: BaseException | None = None
        self._event = asyncio.Event()

    def put(self, delta: RequestOutput | PoolingRequestOutput, now: float) -> int:
        """Keep a delta for the reader; returns how many tokens it adds. A pooling output (one
        embedding, reported once, finished) is its own delta and generates no tokens."""
        new_tokens = 0
        if isinstance(delta, PoolingRequestOutput):
            self.finish_reasons[0] = "stop"  # its one output, complete (metrics, the audit log)
            completions = ()
        else:
            completions = delta.outputs
        for c in completions:
            new_tokens += len(c.token_ids)
            self.sample_tokens[c.index] = self.sample_tokens.get(c.index, 0) + len(c.token_ids)
            if c.finish_reason is not None:
                self.finish_reasons[c.index] = c.finish_reason
            if c.text:
                self.sample_texts.setdefault(c.index, []).append(c.text)
        self.num_generated += new_tokens
        if new_tokens > 0:
            self.first_token_time = self.first_token_time or now
            self.previous_token_time, self.last_token_time = self.last_token_time, now
        self.finished = delta.finished
        if self._unread is None:
            self._unread = delta
        else:
            self._unread.add(delta)
        self._event.set()
        return new_tokens

    def fail(self, error: BaseException) -> None:
        self.finished = True
        self._error = error
        self._event.set()

    async def outputs(self) -> AsyncIterator[RequestOutput]:
        """Deltas until the final one (``output.finished``): everything the engine reported since the
        previous one, each sample's new text, token ids and logprobs."""
        while True:
            if self._unread is None and self._error is None:  # a failure right after an output is not lost
                await self._event.wait()
            self._event.clear()
            output, self._unread = self._unread, None
            if output is not None:
                yield output
                if output.finished:
                    return
            elif self._error is not None:
                raise self._error

    async def final(self) -> RequestOutput | PoolingRequestOutput:
        """The whole output: every delta added up, samples in index order (a pooling output as it came)."""
        whole = None
        async for delta in self.outputs():
            if whole is None:
                whole = delta
            else:
                whole.add(delta)
        if isinstance(whole, RequestOutput):
            whole.outputs.sort(key=lambda c: c.index)
        return whole


class AsyncEngine:
    """Requests and streams on the event loop; subclasses supply the transport to the engine loop.

    A subclass implements ``_launch`` (start delivering reports to ``_on_report`` on the event
    loop), ``_send`` (a command to the engine loop, never blocking for long), ``_shutdown`` and
    ``_running``; it calls ``_fail_all`` on the event loop when the engine dies.
    """

    def __init__(self, info: EngineInfo, stats: Any) -> None:
        self.info = info
        self.stats = stats  # the newest snapshot of the engine's stats(), replaced by every report
        # the loaded LoRA adapters by name (the replica report and /v1/models read it)
        self.lora_adapters: dict[str, LoadedAdapter] = {a.name: a for a in info.lora_adapters}
        self._calls = 0  # LoRA load/unload calls sent (their answer ids)
        self.on_kv_events: Callable[[list[tuple[str, int]]], None] | None = None  # set before start()
        self._listener: OutputListener | None = None
        self._streams: dict[str, RequestStream] = {}
        self._pending: dict[str, asyncio.Future] = {}  # adds the engine loop has not answered yet
        self._loop: asyncio.AbstractEventLoop | None = None
        self._error: BaseException | None = None
        self._started = False
        self._stopping_task: asyncio.Future | None = None

    # -- lifecycle (event loop) ---------------------------------------------------------------
    def start(self, listener: OutputListener | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        self._listener = listener
        self._started = True
        self._launch()

    async def stop(self) -> None:
        """Abort whatever is still running and stop the engine (in-flight HTTP requests are done by now).
        Idempotent: a drain starts it as soon as nothing is in flight, the app's shutdown awaits it."""
        if self._stopping_task is None:
            self._stopping_task = asyncio.ensure_future(self._stop())
        await asyncio.shield(self._stopping_task)

    async def _stop(self) -> None:
        if self._started:
            await self._shutdown()
        self._fail_all(EngineDeadError("the server is shutting down"))

    def end_open_requests(self, reason: str) -> None:
        """End every open request now (a drain's timeout): its reader gets ``EngineDeadError(reason)``
        (a stream ends with an error event, a non-streaming request gets 503) and the engine aborts it."""
        for stream in list(self._streams.values()):
            self._streams.pop(stream.request_id, None)
            stream.fail(EngineDeadError(reason))
            if self._error is None and self._running():
                self._send(Abort(stream.request_id))
            if self._listener is not None:
                self._listener.on_abort(stream)

    def close(self) -> None:
        """Release the engine without the event loop (a shutdown path that never served); idempotent."""

    @property
    def alive(self) -> bool:
        return self._started and self._error is None and self._running()

    @property
    def num_open_requests(self) -> int:
        return len(self._streams)

    # -- requests (event loop) ----------------------------------------------------------------
    async def add(self, request_id: str, prompt: list[int] | str | ChatPrompt,
                  params: SamplingParams | PoolingParams, priority: int = 0,
                  tenant: Tenant | None = None, lora: str | None = None) -> RequestStream:
        """Queue a request and wait until the engine took it; the engine's typed error (``podium.errors``)
        comes back here. A ``ChatPrompt`` is rendered by the engine; ``PoolingParams`` make it an
        embedding request (a pooling model's). ``priority`` orders admission when the engine runs
        ``scheduling_policy="priority"`` (lower first); ``tenant`` shares a saturated engine fairly
        between tenants; ``lora`` names the loaded LoRA adapter it runs with."""
        if not self.alive:
            raise EngineDeadError(f"the engine is not running ({self._error or 'stopped'})")
        if request_id in self._streams or request_id in self._pending:
            raise ValueError(f"request id {request_id!r} is already in use")
        stream = RequestStream(request_id)
        accepted = self._loop.create_future()
        self._pending[request_id] = accepted
        self._streams[request_id] = stream
        self._send(Add(request_id, prompt, params, priority, tenant, lora))
        try:
            await accepted
        except BaseException:
            self._streams.pop(request_id, None)
            self._pending.pop(request_id, None)
            if self._error is None:
                self._send(Abort(request_id))  # harmless if the engine never took it
            raise
        return stream

    async def update_lora(self, name: str, path: str | None) -> LoadedAdapter:
        """Load adapter ``name`` from folder ``path`` (None: unload it) in the engine; returns it. The
        engine's typed error (``AdapterNotFound``, ``InvalidParameter``) comes back here."""
        if not self.alive:
            raise EngineDeadError(f"the engine is not running ({self._error or 'stopped'})")
        self._calls += 1
        call_id = f"lora-update-{self._calls}"
        answered = self._loop.create_future()
        self._pending[call_id] = answered
        self._send(LoRAUpdate(call_id, name, path))
        adapter = await answered
        if path is None:
            self.lora_adapters.pop(name, None)
        else:
            self.lora_adapters[name] = adapter
        return adapter

    def release(self, stream: RequestStream) -> None:
        """Call when done reading a stream: aborts the request if it has not finished."""
        if stream.finished:
            return
        stream.finished = True
        self._streams.pop(stream.request_id, None)
        if self._error is None:
            self._send(Abort(stream.request_id))
        if self._listener is not None:
            self._listener.on_abort(stream)

    # -- transport (subclasses) ---------------------------------------------------------------
    def _launch(self) -> None:
        raise NotImplementedError

    def _send(self, command: Add | Abort | LoRAUpdate) -> None:
        raise NotImplementedError

    async def _shutdown(self) -> None:
        raise NotImplementedError

    def _running(self) -> bool:
        raise NotImplementedError

    # -- delivery (event loop) ----------------------------------------------------------------
    def _on_report(self, report: Report) -> None:
        self.stats = report.stats
        if report.kv_events and self.on_kv_events is not None:
            self.on_kv_events(report.kv_events)
        for request_id, answer in report.answers:
            self._answer(request_id, answer)
        if report.outputs:
            self._deliver(report.outputs)
        for request_id, error in report.failed:
            self._fail_one(request_id, error)

    def _fail_one(self, request_id: str, error: BaseException) -> None:
        """The engine failed this request alone (a fault in its step): its reader gets ``error``."""
        stream = self._streams.pop(request_id, None)
        if stream is None:
            return  # released while the step ran
        stream.fail(error)
        if self._listener is not None:
            self._listener.on_abort(stream, reason="error")

    def _deliver(self, outputs: list[RequestOutput | PoolingRequestOutput]) -> None:
        now = time.monotonic()
        listener = self._listener
        for output in outputs:
            stream = self._streams.get(output.request_id)
            if stream is None:
                continue  # released while this step ran
            new_tokens = stream.put(output, now)
            if listener is not None:
                listener.on_output(stream, output, new_tokens)
            if output.finished:
                del self._streams[output.request_id]

    def _answer(self, request_id: str, answer: int | BaseException) -> None:
        """The engine's answer to an add: the prompt's token count, or why it refused the request."""
        accepted = self._pending.pop(request_id, None)
        if accepted is None or accepted.done():
            return
        if isinstance(answer, BaseException):
            accepted.set_exception(answer)
            return
        stream = self._streams.get(request_id)
        if stream is not None:  # set now: this request's outputs may be delivered before add() resumes
            stream.num_prompt_tokens = answer
        accepted.set_result(answer)

    def _fail_all(self, error: BaseException) -> None:
        self._error = self._error or error
        for rid in list(self._pending):
            self._answer(rid, EngineDeadError(str(error)))
        for stream in self._streams.values():
            stream.fail(EngineDeadError(str(error)))
        self._streams.clear()

    def _post(self, fn: Callable, *args: Any) -> None:
        """Run ``fn(*args)`` on the event loop, from any thread."""
        try:
            self._loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the loop is closed: nobody is listening any more
            pass
