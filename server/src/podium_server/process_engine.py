"""``--engine-mode process``: the engine loop in a child process of its own (multiprocessing, spawn).

    server process (event loop)                          engine process
    add() / release() ── Add / Abort ──► command pipe ──► reader thread ──► SimpleQueue ──► EngineLoop
    _on_report ◄── from_wire ◄── loop.add_reader ◄── report pipe ◄── to_wire ◄── one Report per step (deltas)

The engine and the HTTP server no longer share an interpreter: the model's Python work and the
event loop's never wait for each other's GIL. A report is one pickled message per step, holding
the engine's delta outputs: only what is new (output_wire.py). The event loop never blocks on the pipes: it reads and
writes them through asyncio's pipe transports (multiprocessing.Connection's framing, so the
engine process uses plain ``Connection.recv``/``send``), and the commands of one event-loop turn
go as one message (128 requests arriving at once are one write, not 128 that fill the pipe and
each wait for the engine process's reader thread to get the GIL: seen as 310 ms stalls).

Startup: ``ProcessEngine.launch(factory)`` spawns the child, which builds the engine with
``factory()`` (a picklable callable) and answers with its ``EngineInfo``, tokenizer included (the
server tokenizes completions prompts and ``/tokenize`` itself; chat messages go to the engine,
which renders them), or with the exception that stopped it, raised again here.

Lifetime: the child ignores SIGINT and SIGTERM (a Ctrl-C or a SIGTERM to the whole process group
must not kill it while the server drains requests); it stops on ``Stop``, or when the command
pipe closes (the server exited, however it exited). If it dies (a step raised, or it was killed),
the report pipe closes: every open request fails and ``/health`` answers 503.
"""

from __future__ import annotations

import asyncio
import atexit
import gc
import logging
import multiprocessing as mp
import os
import pickle
import queue
import signal
import struct
import sys
import threading
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

from .async_engine import AsyncEngine, EngineDeadError, EngineInfo
from .engine_loop import Abort, Add, EngineLoop, Report, Stop
from .output_wire import from_wire, to_wire

logger = logging.getLogger("podium_server")
STOP_TIMEOUT_S = 60.0  # how long the engine process gets to finish its step and exit before it is killed


class ProcessEngine(AsyncEngine):
    """Serves the engine that ``factory()`` builds, from a child process."""

    def __init__(self, process: mp.process.BaseProcess, commands: Connection, reports: Connection,
                 info: EngineInfo, stats: Any) -> None:
        super().__init__(info, stats)
        self.process = process
        self._commands, self._reports = commands, reports
        self._connected: asyncio.Task | None = None  # attaching the pipes to the event loop
        self._writer: asyncio.WriteTransport | None = None
        self._reader: asyncio.ReadTransport | None = None
        self._outbox: list[Add | Abort | Stop] = []  # commands of this event-loop turn, sent as one message
        self._stopping = False  # a stop was asked for: the pipes closing is no news
        self._detached = False

    @classmethod
    def launch(cls, factory: Callable[[], Any]) -> ProcessEngine:
        """Start the engine process and wait until its engine is built (blocking: call before serving)."""
        ctx = mp.get_context("spawn")
        command_reader, command_writer = ctx.Pipe(duplex=False)
        report_reader, report_writer = ctx.Pipe(duplex=False)
        process = ctx.Process(target=serve_engine, args=(factory, command_reader, report_writer),
                              name="podium-engine")
        process.start()
        command_reader.close()  # the child's ends: closed here, so either side sees EOF when the other goes
        report_writer.close()
        atexit.register(_reap, process, command_writer)
        try:
            message = report_reader.recv()
        except EOFError:
            process.join()
            raise RuntimeError(f"the engine process exited with code {process.exitcode} while starting") from None
        if message[0] != "ready":
            process.join()
            raise message[1]
        _, info, stats = message
        return cls(process, command_writer, report_reader, info, stats)

    def close(self) -> None:
        """Stop the engine process without the event loop (shutdown paths that never served)."""
        self._stopping = True
        _reap(self.process, self._commands)

    # -- transport (event loop) ---------------------------------------------------------------
    def _launch(self) -> None:
        self._connected = self._loop.create_task(self._connect())

    async def _connect(self) -> None:
        self._writer, _ = await self._loop.connect_write_pipe(asyncio.Protocol, self._commands)
        self._reader, _ = await self._loop.connect_read_pipe(lambda: _Frames(self._on_message, self._died),
                                                             self._reports)
        self._flush()

    def _send(self, command: Add | Abort | Stop) -> None:
        if not self._outbox:
            self._loop.call_soon(self._flush)
        self._outbox.append(command)

    def _flush(self) -> None:
        if not self._outbox or self._writer is None:
            return  # nothing to send, or not connected yet (_connect flushes)
        commands, self._outbox = self._outbox, []
        if not self._writer.is_closing():  # else the engine process is gone: the report pipe's EOF says so
            self._writer.write(_frame(commands))

    async def _shutdown(self) -> None:
        self._stopping = True
        await self._connected
        self._send(Stop())
        self._flush()
        await asyncio.to_thread(self.process.join, STOP_TIMEOUT_S)
        if self.process.is_alive():
            logger.warning("the engine process did not stop within %.0f s; killing it", STOP_TIMEOUT_S)
            self.process.kill()
            await asyncio.to_thread(self.process.join)
        self._detach()

    def _running(self) -> bool:
        return self.process.is_alive()

    # -- reports (event loop) -----------------------------------------------------------------
    def _on_message(self, message: tuple) -> None:
        if message[0] == "report":
            self._on_report(self._decode(message))
        else:  # "died"
            self._died(message[1])

    def _decode(self, message: tuple) -> Report:
        _, stats, answers, deltas, aborted, kv_events, failed = message
        return Report(stats, answers, [from_wire(delta) for delta in deltas], aborted, kv_events, failed)

    def _died(self, reason: str | None = None) -> None:
        """The report pipe closed (or said why first): the engine process is gone or going."""
        if self._detached:
            return
        self._detach()
        if self._stopping:
            return
        self.process.join(timeout=1.0)  # it is exiting: its exit code tells a crash from a kill
        reason = reason or f"the engine process exited unexpectedly (exit code {self.process.exitcode})"
        logger.error("%s", reason)
        self._fail_all(EngineDeadError(reason))

    def _detach(self) -> None:
        """Close both pipes (a transport closes its own, once it has written what it holds)."""
        self._detached = True
        for transport, pipe in ((self._reader, self._reports), (self._writer, self._commands)):
            if transport is not None:
                transport.close()
            else:
                pipe.close()


class _Frames(asyncio.Protocol):
    """Messages in multiprocessing.Connection's framing, read without ever blocking the event loop."""

    def __init__(self, on_message: Callable[[Any], None], on_eof: Callable[[], None]) -> None:
        self._on_message, self._on_eof = on_message, on_eof
        self._buffer = bytearray()

    def data_received(self, data: bytes) -> None:
        buffer = self._buffer
        buffer += data
        while len(buffer) >= 4:
            (size,), start = struct.unpack_from("!i", buffer), 4
            if size == -1:  # a message over 2 GiB: an 8-byte size follows
                if len(buffer) < 12:
                    return
                (size,), start = struct.unpack_from("!Q", buffer, 4), 12
            if len(buffer) < start + size:
                return
            with memoryview(buffer) as view:
                message = pickle.loads(view[start:start + size])
            del buffer[:start + size]
            self._on_message(message)

    def connection_lost(self, exc: Exception | None) -> None:
        self._on_eof()


def _frame(obj: Any) -> bytes:
    """``obj`` pickled in multiprocessing.Connection's framing (what ``Connection.recv`` reads)."""
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    size = struct.pack("!i", len(data)) if len(data) <= 0x7FFFFFFF else struct.pack("!iQ", -1, len(data))
    return size + data


def _reap(process: mp.process.BaseProcess, commands: Connection) -> None:
    """Make sure the engine process is gone: close its command pipe (it stops), then kill it if it must."""
    if not commands.closed:
        commands.close()
    process.join(timeout=10)
    if process.is_alive():
        process.kill()
        process.join()


# -- the engine process ------------------------------------------------------------------------
def serve_engine(factory: Callable[[], Any], commands: Connection, reports: Connection) -> None:
    """The engine process's main: build the engine, say ready, run the loop until Stop or EOF."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the server decides when this process stops
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        engine = factory()
        reports.send(("ready", EngineInfo.of(engine), engine.stats()))
    except BaseException as exc:
        reports.send(("failed", portable(exc)))
        sys.exit(1)
    freeze_startup_objects()
    inbox: queue.SimpleQueue = queue.SimpleQueue()
    threading.Thread(target=_forward, args=(commands, inbox), name="podium-commands", daemon=True).start()

    def report(r: Report) -> None:
        answers = [(request_id, portable(answer)) for request_id, answer in r.answers]
        failed = [(request_id, portable(error)) for request_id, error in r.failed]
        reports.send(("report", r.stats, answers, [to_wire(output) for output in r.outputs], r.aborted, r.kv_events,
                      failed))

    failure: list[BaseException] = []
    # Steps run on a thread other than the one that built the engine: on a crowded CPU, without
    # OMP_WAIT_POLICY=PASSIVE, torch on the loading thread ran ~6x slower (OpenMP spin-waiting
    # for cores); the thread mode and the offline benchmark step on fresh threads too.
    stepper = threading.Thread(target=_run_loop, args=(EngineLoop(engine, inbox, report), failure),
                               name="podium-engine")
    stepper.start()
    stepper.join()
    if failure:
        try:
            reports.send(("died", f"the engine loop died: {type(failure[0]).__name__}: {failure[0]}"))
        except OSError:
            pass
        sys.exit(1)
    # a clean stop: everything was reported; stop the tensor-parallel workers (os._exit skips atexit),
    # then skip tearing down the model and torch object by object (seconds on a busy host), the
    # server is waiting for this exit to finish its own
    getattr(engine, "shutdown", lambda: None)()
    reports.close()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _run_loop(loop: EngineLoop, failure: list[BaseException]) -> None:
    try:
        loop.run()
    except BaseException as exc:
        logger.exception("the engine loop died")
        failure.append(exc)


def _forward(commands: Connection, inbox: queue.SimpleQueue) -> None:
    """The engine process's reader: every command into the loop's inbox; Stop when the server is gone."""
    try:
        while True:
            for command in commands.recv():
                inbox.put(command)
    except (EOFError, OSError):
        inbox.put(Stop())


def freeze_startup_objects() -> None:
    """Keep the objects made while starting (model, tokenizer, imported modules: millions) out of
    every later garbage collection: a full collection over them stopped the server's event loop
    for 300-400 ms under load (seen with /health probes)."""
    gc.collect()
    gc.freeze()


def portable(error: Any) -> Any:
    """``error`` if it survives pickling, else a RuntimeError with its type and message (anything
    but an exception passes as it is)."""
    if not isinstance(error, BaseException):
        return error
    try:
        pickle.loads(pickle.dumps(error))
        return error
    except Exception:
        return RuntimeError(f"{type(error).__name__}: {error}")
