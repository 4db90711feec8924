"""The loop that drives an ``LLMEngine`` for the server: the same code on a thread or in a child process.

    inbox (queue.SimpleQueue of Add / Abort / LoRAUpdate / Stop) ──► EngineLoop.run()
        apply every queued command; while there is work: one engine.step()
    report(Report) ◄── one Report per step: the answers to adds, the step's outputs, stats after it

Every request is added with ``output_kind="delta"``: a step's outputs hold only what is new, so
a report's size follows the step's new tokens, never the length of what was generated so far.

Batching per step keeps the cost per token low: whoever receives the reports (the event loop,
through a thread callback or a pipe) wakes once per step, not once per request. Answers to adds
go out as soon as the adds are applied (a bad request hears about it without waiting for a step).
Only this loop touches the engine. It returns on ``Stop`` (aborting what still runs) and raises
if the engine dies (the engine recovers from a failed step itself and reports the requests it
failed: ``Report.failed``); its caller reports that as the engine's death.
"""

from __future__ import annotations

import queue
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from podium.chat_template import ChatPrompt
from podium.errors import RequestFailed
from podium.lora.request import AdapterRef
from podium.outputs import PoolingRequestOutput, RequestOutput
from podium.pooling_params import PoolingParams
from podium.sampling_params import SamplingParams
from podium.tenant import Tenant

IDLE_WAIT_S = 0.005  # when a step made no progress, wait this long for a command before stepping again
HEALTH_CHECK_S = 1.0  # while idle, ask the engine this often whether it can still serve (check_alive)


@dataclass
class Add:
    request_id: str
    prompt: list[int] | str | ChatPrompt  # token ids, text, or messages for the engine's chat template
    params: SamplingParams | PoolingParams  # PoolingParams: an embedding request
    priority: int = 0  # admission order under scheduling_policy="priority" (lower first)
    tenant: Tenant | None = None  # fair share between tenants (None: the default tenant)
    lora: str | None = None  # the name of a loaded LoRA adapter to run it with (None: the base model)


@dataclass
class Abort:
    request_id: str


@dataclass
class LoRAUpdate:
    """Load (``path`` given) or unload a LoRA adapter; answered like an add, with its ``LoadedAdapter`` or the error."""

    call_id: str
    name: str
    path: str | None = None


class Stop:
    pass


@dataclass(frozen=True)
class LoadedAdapter:
    """A LoRA adapter as the server shows it: its name, its folder, and the text its blocks' hashes
    digest after the token ids (``LLMEngine.block_hash_extra``: a router that recomputes the hashes
    of a request naming it needs this)."""

    name: str
    path: str
    block_hash_extra: str

    @classmethod
    def of(cls, engine: Any, ref: AdapterRef) -> LoadedAdapter:
        return cls(ref.name, ref.path, engine.block_hash_extra(ref))


@dataclass
class Report:
    """What one iteration of the loop did, sent as one message."""

    stats: Any  # the engine's stats() after it
    # per add: the prompt's token count (accepted) or the error that refused it
    answers: list[tuple[str, int | BaseException]] = field(default_factory=list)
    outputs: list[RequestOutput | PoolingRequestOutput] = field(default_factory=list)  # deltas
    aborted: list[str] = field(default_factory=list)  # requests dropped by an Abort in this iteration
    kv_events: list[tuple[str, int]] = field(default_factory=list)  # the prefix cache's, in order (replica.py)
    # requests the engine failed (a fault in a step they were part of): their error; they are over
    failed: list[tuple[str, BaseException]] = field(default_factory=list)


class EngineLoop:
    def __init__(self, engine: Any, inbox: queue.SimpleQueue, report: Callable[[Report], None]) -> None:
        self.engine = engine
        self._inbox = inbox
        self._report = report
        self._active: set[str] = set()  # accepted, not finished, not aborted
        self._answers: list[tuple[str, int | BaseException]] = []
        self._aborted: list[str] = []
        # the prefix cache's block events, for routers (replica.py); the cache's state so far as "stored"
        self._take_kv_events = getattr(engine, "take_kv_events", list)
        enable = getattr(engine, "enable_kv_events", None)
        self._kv_events = [("stored", h) for h in enable()] if enable is not None else []

    def run(self) -> None:
        """Serve commands until ``Stop``; raises whatever a step raises."""
        engine = self.engine
        while True:
            if not engine.has_unfinished_requests():
                self._flush([], idle=True)
                if not self._apply(self._next_command()):
                    break
            if not self._drain():
                break
            if self._answers or self._aborted:
                self._flush([])
            if engine.has_unfinished_requests() and not self._step():
                break
        if self._active:
            engine.abort_request(sorted(self._active))
            self._aborted.extend(sorted(self._active))
            self._active.clear()
        self._flush([], idle=True)

    def _step(self) -> bool:
        """One engine step and its report; False if a stop command arrived while idling."""
        started = time.perf_counter()
        outputs = self.engine.step()
        if outputs:
            self._flush(outputs)
        elif getattr(self.engine, "has_step_in_flight", lambda: False)():
            pass  # async scheduling: this step's tokens come with the next one; step again at once
        elif time.perf_counter() - started < 1e-3:  # nothing could be scheduled: don't spin
            return self._drain(timeout=IDLE_WAIT_S)
        return True

    def _next_command(self) -> Any:
        """Wait for a command; meanwhile an engine that can no longer serve (a tensor-parallel rank
        died) raises from ``check_alive``, so the server turns unhealthy without waiting for a request."""
        check = getattr(self.engine, "check_alive", None)
        while True:
            try:
                return self._inbox.get(timeout=HEALTH_CHECK_S if check is not None else None)
            except queue.Empty:
                check()

    def _drain(self, timeout: float | None = None) -> bool:
        """Apply every queued command (waiting up to ``timeout`` for the first); False on stop."""
        try:
            command = self._inbox.get(timeout=timeout) if timeout else self._inbox.get_nowait()
        except queue.Empty:
            return True
        while True:
            if not self._apply(command):
                return False
            try:
                command = self._inbox.get_nowait()
            except queue.Empty:
                return True

    def _apply(self, command: Any) -> bool:
        if isinstance(command, Add):
            # an engine that knows nothing of tenants (or LoRA) still serves requests that have none
            extra = {"tenant": command.tenant} if command.tenant is not None else {}
            if command.lora is not None:
                extra["lora_request"] = command.lora
            try:
                num_prompt_tokens = self.engine.add_request(command.request_id, command.prompt, command.params,
                                                            priority=command.priority, output_kind="delta", **extra)
            except Exception as exc:  # a bad request is that request's problem, never the loop's
                self._answers.append((command.request_id, exc))
            else:
                self._active.add(command.request_id)
                self._answers.append((command.request_id, num_prompt_tokens))
        elif isinstance(command, Abort):
            if command.request_id in self._active:
                self._active.discard(command.request_id)
                self.engine.abort_request(command.request_id)
                self._aborted.append(command.request_id)
        elif isinstance(command, LoRAUpdate):
            self._answers.append((command.call_id, self._update_lora(command)))
        elif isinstance(command, Stop):
            return False
        return True

    def _update_lora(self, command: LoRAUpdate) -> LoadedAdapter | BaseException:
        try:
            if command.path is None:
                ref = self.engine.unload_lora(command.name)
            else:
                ref = self.engine.load_lora(command.name, command.path)
        except Exception as exc:  # a bad folder or name is that call's problem, never the loop's
            return exc
        return LoadedAdapter.of(self.engine, ref)

    def _flush(self, outputs: list[RequestOutput | PoolingRequestOutput], idle: bool = False) -> None:
        """Report what happened since the last report (when idle, the stats even if nothing did)."""
        failed = []
        for output in outputs:
            if output.finished:
                self._active.discard(output.request_id)
            if getattr(output, "error", None) is not None:
                failed.append((output.request_id, RequestFailed(output.error)))
        if failed:
            outputs = [output for output in outputs if getattr(output, "error", None) is None]
        events, self._kv_events = self._kv_events + self._take_kv_events(), []
        if outputs or self._answers or self._aborted or idle or events or failed:
            report = Report(self.engine.stats(), self._answers, outputs, self._aborted, events, failed)
            self._answers, self._aborted = [], []
            self._report(report)
