"""``--engine-mode process``: the engine loop in a child process of its own (multiprocessing, spawn).

    server process (event loop)                          engine process
    add() / release() ── Add / Abort ──► command pipe ──► reader thread ──► SimpleQueue ──► EngineLoop
    _on_report ◄── DeltaDecoder ◄── loop.add_reader ◄── report pipe ◄── DeltaEncoder ◄── one Report per step

The engine and the HTTP server no longer share an interpreter: the model's Python work and the
event loop's never wait for each other's GIL. A report is one pickled message per step, holding
only what is new (output_deltas.py). The event loop reads it when the pipe is readable (no
reader thread in the server); the engine process reads commands on a thread, so the server's
sends never wait for a step.

Startup: ``ProcessEngine.launch(factory)`` spawns the child, which builds the engine with
``factory()`` (a picklable callable) and answers with its ``EngineInfo``, tokenizer included (the
server tokenizes and renders chat templates itself), or with the exception that stopped it,
raised again here.

Lifetime: the child ignores SIGINT and SIGTERM (a Ctrl-C or a SIGTERM to the whole process group
must not kill it while the server drains requests); it stops on ``Stop``, or when the command
pipe closes (the server exited, however it exited). If it dies (a step raised, or it was killed),
the report pipe closes: every open request fails and ``/health`` answers 503.
"""

from __future__ import annotations

import asyncio
import atexit
import logging
import multiprocessing as mp
import pickle
import queue
import signal
import sys
import threading
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

from .async_engine import AsyncEngine, EngineDeadError, EngineInfo
from .engine_loop import Abort, Add, EngineLoop, Report, Stop
from .output_deltas import DeltaDecoder, DeltaEncoder

logger = logging.getLogger("podium_server")
STOP_TIMEOUT_S = 60.0  # how long the engine process gets to finish its step and exit before it is killed


class ProcessEngine(AsyncEngine):
    """Serves the engine that ``factory()`` builds, from a child process."""

    def __init__(self, process: mp.process.BaseProcess, commands: Connection, reports: Connection,
                 info: EngineInfo, stats: Any) -> None:
        super().__init__(info, stats)
        self.process = process
        self._commands, self._reports = commands, reports
        self._decoder = DeltaDecoder()
        self._stopping = False

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

    # -- transport ----------------------------------------------------------------------------
    def _launch(self) -> None:
        self._loop.add_reader(self._reports.fileno(), self._on_readable)

    def _send(self, command: Add | Abort | Stop) -> None:
        if isinstance(command, Add):
            self._decoder.open(command.request_id, command.prompt)
        elif isinstance(command, Abort):
            self._decoder.close(command.request_id)
        try:
            self._commands.send(command)
        except (OSError, ValueError):  # the engine process is gone: its pipe's EOF reports that
            pass

    async def _shutdown(self) -> None:
        self._stopping = True
        self._send(Stop())
        await asyncio.to_thread(self.process.join, STOP_TIMEOUT_S)
        if self.process.is_alive():
            logger.warning("the engine process did not stop within %.0f s; killing it", STOP_TIMEOUT_S)
            self.process.kill()
            await asyncio.to_thread(self.process.join)
        self._detach()

    def _running(self) -> bool:
        return self.process.is_alive()

    # -- reports (event loop) -----------------------------------------------------------------
    def _on_readable(self) -> None:
        try:
            while self._reports.poll():
                message = self._reports.recv()
                if message[0] == "report":
                    self._on_report(self._decode(message))
                else:  # "died"
                    self._died(message[1])
                    return
        except (EOFError, OSError):
            self._died(None)

    def _decode(self, message: tuple) -> Report:
        _, stats, answers, deltas, aborted = message
        for request_id, error in answers:
            if error is not None:
                self._decoder.close(request_id)
        outputs = [output for output in map(self._decoder.decode, deltas) if output is not None]
        return Report(stats, answers, outputs, aborted)

    def _died(self, reason: str | None) -> None:
        self._detach()
        if self._stopping:
            return
        self.process.join(timeout=1.0)  # it is exiting: its exit code tells a crash from a kill
        reason = reason or f"the engine process exited unexpectedly (exit code {self.process.exitcode})"
        logger.error("%s", reason)
        self._fail_all(EngineDeadError(reason))

    def _detach(self) -> None:
        if self._loop is not None and not self._reports.closed:
            self._loop.remove_reader(self._reports.fileno())
        self._reports.close()
        self._commands.close()


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
    inbox: queue.SimpleQueue = queue.SimpleQueue()
    threading.Thread(target=_forward, args=(commands, inbox), name="podium-commands", daemon=True).start()
    encoder = DeltaEncoder()

    def report(r: Report) -> None:
        encoder.forget(r.aborted)
        answers = [(request_id, portable(error)) for request_id, error in r.answers]
        reports.send(("report", r.stats, answers, [encoder.encode(output) for output in r.outputs], r.aborted))

    try:
        EngineLoop(engine, inbox, report).run()
    except BaseException as exc:
        logger.exception("the engine loop died")
        try:
            reports.send(("died", f"the engine loop died: {type(exc).__name__}: {exc}"))
        except OSError:
            pass
        sys.exit(1)


def _forward(commands: Connection, inbox: queue.SimpleQueue) -> None:
    """The engine process's reader: every command into the loop's inbox; Stop when the server is gone."""
    try:
        while True:
            inbox.put(commands.recv())
    except (EOFError, OSError):
        inbox.put(Stop())


def portable(error: BaseException | None) -> BaseException | None:
    """``error`` if it survives pickling, else a RuntimeError with its type and message."""
    if error is None:
        return None
    try:
        pickle.loads(pickle.dumps(error))
        return error
    except Exception:
        return RuntimeError(f"{type(error).__name__}: {error}")
