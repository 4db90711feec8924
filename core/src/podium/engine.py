"""``LLMEngine``: requests in, tokens out, one ``step()`` at a time.

Startup: discover the plugins, select and activate the platform with its options, bind its device
(``platform_setup``) -> resolve the model -> build it on the device (refused if its attention needs
what the platform lacks) -> size and allocate the KV cache -> capture decode graphs where the
platform can. A step: the scheduler plans (which sequences, how many tokens, which blocks), the
plan goes to the runner as plain data (``runner.plan_step``), the runner executes it and returns
the logits to sample, the sampler samples (now, or deferred), the scheduler advances computed
tokens, the output processor appends sampled tokens and finishes sequences. Everything
platform-specific goes through the platform. With ``tensor_parallel_size`` n > 1 this process is
rank 0 of n (``parallel.worker``): its ``ModelShard`` holds one shard, it sends each plan to the
other ranks before running it, and it alone schedules and samples; a dead rank is ``EngineDead``.
A pooling (embedding) model runs its own kind of step instead (``pooling_step``: whole inputs, one
embedding each, reported once, finished), on one device.
A request with structured output waits outside the scheduler until its grammar has compiled in
the background (``podium.structured``); each step first queues the ones that are ready, so no step
waits for a compilation.

Async scheduling (``async_scheduling``; on where the platform asks for it: accelerators, whose
steps run while the host goes on; never where the platform samples on the host). A step N whose sampling needs nothing from the host is left
in flight: each of its sequences gets a placeholder token (-1) and ``step()`` returns. The next
``step()`` plans and launches N+1 at once (the placeholders read N's tokens on the device), and
only then waits for N's tokens, fills the placeholders, applies the stop rules and reports N,
so the host's work overlaps the device's. A sequence that N finished (EOS, a stop string) has
computed one token too many in N+1; it is dropped. A sequence that N ends by length gets no
placeholder, and steps that need tokens on the host (penalties, logprobs, prompt logprobs) run
synchronously. Reports therefore come one ``step()`` later; the tokens are the same.

Speculative decoding (``speculative_config``; ``podium.spec``, driven by its ``Speculator``). Before
planning, each running sequence in decode gets up to k drafts (n-gram) or k reserved draft slots (a
draft model or EAGLE head); the scheduler gives a sequence its drafts where the budget and blocks
allow; a drafter fills the kept slots on the device; one forward computes them; ``spec.verify``
samples the target row by row, booking each token, and the scheduler counts the accepted ones as
computed and gives back the blocks of the rejected; then the drafter sees the booked step (an EAGLE
head mirrors the target's hidden states). Such steps run synchronously (speculation turns async
scheduling off).

LoRA (``enable_lora``; ``podium.lora``). A request may name an adapter (``lora_request``): its
sequences carry the adapter's handle, the scheduler admits them only with a device slot for it, the
plan says which slot each sequence's rows use, and the prefix cache keys their blocks by adapter.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable
from collections.abc import Sequence as Seq
from concurrent import futures
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

import torch

from podium_plugin_api import Platform

from .block_manager import BLOCK_HASH_SCHEME, BlockManager, adapter_extra_keys, extra_keys_text
from .chat_template import ChatPrompt, render_chat
from .config import EngineConfig
from .engine_args import engine_config
from .engine_stats import EngineStats
from .errors import EngineDead, InvalidParameter, PromptTooLong, StepFault, check_context
from .explicit_fields import with_fallbacks
from .kv_cache import dtype_name, kv_sizing_note
from .loader import resolve_model, sampling_defaults
from .lora.registry import AdapterRegistry
from .lora.request import AdapterRef, LoRARequest
from .lora.slots import SlotTable
from .models.registry import model_class
from .output_processor import OUTPUT_KINDS, OutputKind, OutputProcessor, RequestState
from .outputs import PoolingRequestOutput, RequestMetrics, RequestOutput
from .parallel.worker import start_workers
from .platform_setup import start_platform
from .pooling_params import PoolingParams
from .pooling_step import PoolingRequest, failed_output, pooling_step, select_pooler
from .quantization import select_quantization
from .request import Sequence, SequenceStatus
from .request_limits import bound_to_vocab
from .runner import LaunchedStep, StepResult, launch, plan_step, prompt_logprobs, sample_now
from .sampler import Sampler
from .sampling_params import SamplingParams
from .scheduler import Scheduler, SchedulerOutput
from .shard import ModelShard
from .spec.speculator import build_speculator, draft_companion
from .spec.verify import verify
from .startup import StartupTimer, format_startup
from .structured import GrammarService
from .tenant import DEFAULT_TENANT, Tenant

logger = logging.getLogger(__name__)

_FINISHED = SequenceStatus.FINISHED
MAX_CONSECUTIVE_FAULTS = 3  # steps in a row failing with no request to blame: the device is gone


@dataclass
class VerifyStep:
    """A step that computed drafts: the logits of each sampling sequence's last token and drafts."""

    logits: torch.Tensor  # [sum(len(drafts) + 1), V]
    seqs: list[Sequence]  # the sampling sequences, in row order
    drafts: list[list[int]]  # per sequence (empty: it decodes one token)
    items: list  # per sequence: its ScheduledSequence (num_accepted is set on it)
    prompt_logprobs: dict[int, list]
    num_tokens: int


def grad_off(platform: Platform) -> Callable[[], AbstractContextManager]:
    """torch.inference_mode where the platform supports it, torch.no_grad where not (torch_xla)."""
    return torch.inference_mode if platform.capabilities().inference_mode else torch.no_grad


class LLMEngine:
    def __init__(self, config: EngineConfig | None = None, **kwargs) -> None:
        timer = StartupTimer()  # see podium.startup for the stages
        config = config if config is not None else engine_config(**kwargs)
        started = start_platform(config, rank=0 if config.tensor_parallel_size > 1 else None)
        self.platform = platform = started.platform
        self.platform_name = started.name
        self.config = config = config.with_defaults(platform.config_defaults())
        self.grad_off = grad_off(platform)
        note = kv_sizing_note(config, platform)
        if note:
            logger.warning("%s", note)
        timer.lap("platform", detail=started.name)
        source = resolve_model(config.model, config.tokenizer, config.tokenizer_cache)
        timer.lap("config", inner=source.load_seconds, detail=source.description)
        self.source, self.tokenizer = source, source.tokenizer
        self.sampling_defaults = sampling_defaults(config.generation_config, source)
        if self.sampling_defaults:
            logger.info("sampling defaults from generation_config.json (generation_config=%s; a request's own "
                        "values win): %s", config.generation_config, self.sampling_defaults)
        self.model_name = config.served_model_name or config.model
        model_cls = model_class(source.hf_config, started.plugins.model_architectures())
        # a pooling model (embeddings) or None (text); the folder may cap the input length
        self.pooler, input_cap = select_pooler(config.runner, model_cls, source, config.pooler_config, self.model_name)
        if self.pooler is not None and config.tensor_parallel_size > 1:
            raise ValueError(f"tensor_parallel_size={config.tensor_parallel_size}: pooling (embedding) models run on "
                             "one device only; use tensor_parallel_size=1")
        self.max_model_len = self._max_model_len(config, source.max_model_len, input_cap)
        self.quantization = self._quantization(config, source, started)
        # a draft model or EAGLE head (podium.spec), built by the shard next to the target; checked first
        companion = draft_companion(config.speculative_config, config, started.plugins.quantization_methods())
        self.tp = start_workers(config, platform, source.hf_config) if config.tensor_parallel_size > 1 else None
        try:
            self.shard = shard = ModelShard(config, started, source, self.max_model_len, self.grad_off, timer, self.tp,
                                            self.quantization, pooling=self.pooler is not None, companion=companion)
            self.dtype, self.kv_cache_dtype, self.device, self.ops = shard.dtype, shard.kv_cache_dtype, shard.device, \
                shard.ops
            # the hardware this engine computes on (rank 0's), which a router groups co-located replicas by
            self.device_key = platform.device_key(self.device.index or 0)
            self.model, self.kv_caches, self.runner = shard.model, shard.kv_caches, shard.runner
            self.weight_bytes = shard.weight_bytes
            self.num_kv_blocks, self.kv_capacity_tokens = shard.num_kv_blocks, shard.kv_capacity_tokens
            if shard.kv_caches:
                logger.info("KV cache: %d blocks of %d tokens (%d tokens), %s, %.2f GiB", shard.num_kv_blocks,
                            config.block_size, shard.kv_capacity_tokens, dtype_name(shard.kv_cache_dtype),
                            shard.kv_bytes / 2**30)
            else:  # an encoder
                logger.info("no KV cache: the model attends within each step (%d bookkeeping blocks)",
                            shard.num_kv_blocks)
            self.loras = AdapterRegistry(shard.lora.register, shard.lora.forget) if shard.lora is not None \
                else None
            self._build_scheduler_and_sampler(source)
            shard.capture_graphs()
        except BaseException:
            self.shutdown()
            raise
        timer.lap("graph_capture", detail=self._graphs_detail())
        self.startup_seconds = timer.finish()
        logger.info("%s (model %s on %s)", format_startup(self.startup_seconds), self.model_name, self.platform_name)
        self.processor = OutputProcessor(self.tokenizer, source.eos_token_ids, self.max_model_len)
        spec = config.speculative_config
        self.speculator = build_speculator(spec, self.shard.companion, config.max_num_seqs)
        self._kept_hidden = None  # what the target's runner kept of the running step's hidden states
        self.async_scheduling = (bool(config.async_scheduling) and not self.runner.shaping.sample_on_host
                                 and spec is None and self.pooler is None)  # verification books tokens on the host
        self._in_flight: LaunchedStep | None = None  # the deferred step whose tokens are unread
        self.grammars = GrammarService(self.tokenizer, source.hf_config.vocab_size, source.eos_token_ids,
                                       config.structured_outputs_backend)
        self._compiling: list[Sequence] = []  # constrained sequences whose grammar is not compiled yet
        self._requests: dict[str, RequestState | PoolingRequest] = {}
        self._seq_ids = itertools.count()
        self._prefill_tokens = 0  # prompt (not decode) tokens computed, over the engine's life
        self._prefill_seconds = 0.0  # their share of the steps' wall time
        self._decode_steps = 0  # steps of decodes only
        self._decode_seconds = 0.0
        self._step_work: tuple[SchedulerOutput, LaunchedStep | None] | None = None  # the running step, once planned
        self._consecutive_faults = 0
        # a test hook: called with each step's plan (text or pooling) before it runs; what it raises is a fault of that step
        self.fault_injector: Callable[[SchedulerOutput], None] | None = None

    # -- setup ---------------------------------------------------------------------------------
    @property
    def is_pooling(self) -> bool:
        """Whether this engine computes embeddings (a pooling model) rather than text."""
        return self.pooler is not None

    def _graphs_detail(self) -> str:
        if self.pooler is not None:
            return "none: a pooling model computes no decode steps"
        if self.config.enforce_eager:
            return "off: enforce_eager"
        if not self.platform.capabilities().graph_capture:
            return f"none: {self.platform_name} captures no graphs"
        sizes = sorted(self.runner.graphs)
        return f"batch sizes {', '.join(map(str, sizes))}" if sizes else "none: steps run eagerly"

    @staticmethod
    def _max_model_len(config: EngineConfig, model_len: int, input_cap: int | None = None) -> int:
        """The user's max_model_len (at most the model's), else the model's, capped by a pooling
        model's folder (sentence-transformers' ``max_seq_length``)."""
        if config.max_model_len is None:
            return min(model_len, input_cap) if input_cap else model_len
        if config.max_model_len > model_len:
            raise ValueError(f"max_model_len={config.max_model_len} exceeds the model's context length {model_len}")
        return config.max_model_len

    @staticmethod
    def _quantization(config: EngineConfig, source, started):
        """The quantization method the model runs with (``podium.quantization``; None: float weights),
        refused with tensor parallelism before any worker starts: ``parallel.sharding`` slices float
        weights only, and quantized layers are not sharded by rank yet."""
        method = select_quantization(config.quantization, source.quantization, started.plugins.quantization_methods())
        if method is None or config.tensor_parallel_size == 1:
            return method
        if config.quantization is None:  # the checkpoint's own format: only one rank can hold it
            raise ValueError(f"this checkpoint is quantized ({method.name}, its quantization_config) and quantized "
                             f"layers do not run with tensor_parallel_size={config.tensor_parallel_size} yet; use "
                             f"tensor_parallel_size=1 or a float checkpoint")
        raise ValueError(f"quantization={config.quantization!r} and tensor_parallel_size={config.tensor_parallel_size} "
                         f"do not run together yet (quantized layers are not sharded by rank); use "
                         f"tensor_parallel_size=1, or leave quantization unset to shard the float (or, for a GGUF "
                         f"file, dequantized) weights")

    def _build_scheduler_and_sampler(self, source) -> None:
        config = self.config
        pooling = self.pooler is not None
        # a pooling model caches no prefix: each input is computed whole and its blocks freed at once
        self.block_manager = BlockManager(self.num_kv_blocks, config.block_size,
                                          config.enable_prefix_caching and not pooling)
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs, self.shard.token_budget,
                                   self.max_model_len, config.scheduling_policy, chunked_prefill=not pooling,
                                   lora_slots=SlotTable(config.max_loras) if self.loras is not None else None)
        on_host = self.runner.shaping.sample_on_host  # where the platform's steps sample
        self.sampler = Sampler(source.hf_config.vocab_size, torch.device("cpu") if on_host else self.device,
                               ops=None if on_host else self.ops, eos_token_ids=source.eos_token_ids, seed=config.seed,
                               batch_invariant=config.batch_invariant)

    def check_alive(self) -> None:
        """Raise EngineDead if the engine can no longer serve (a tensor-parallel rank is gone)."""
        if self.tp is not None:
            self.tp.check()

    def shutdown(self) -> None:
        """Stop the tensor-parallel workers (nothing to do without them); the engine serves no more."""
        tp, self.tp = getattr(self, "tp", None), None
        if tp is not None:
            tp.shutdown()

    # -- requests ------------------------------------------------------------------------------
    def encode_prompt(self, prompt: str | list[int] | ChatPrompt, param: str = "prompt") -> tuple[str | None, list[int]]:
        """(text, token ids) of a prompt: text is tokenized, a ``ChatPrompt`` rendered by its template.
        ``param`` names the prompt in the errors (an embedding request's is "input")."""
        if isinstance(prompt, ChatPrompt):
            return None, render_chat(self.tokenizer, prompt, self.model_name)
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise InvalidParameter("this model has no tokenizer; pass prompt token ids instead of text",
                                       param=param)
            return prompt, self.tokenizer.encode(prompt)
        ids = [int(t) for t in prompt]
        vocab = self.source.hf_config.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise InvalidParameter(f"prompt token ids must be in [0, {vocab}); got {bad[:5]}", param=param)
        return None, ids

    def add_request(self, request_id: str, prompt: str | list[int] | ChatPrompt, params: SamplingParams | None = None,
                    arrival_time: float | None = None, priority: int = 0, output_kind: OutputKind = "cumulative",
                    final_only: bool = False, tenant: Tenant | None = None,
                    lora_request: LoRARequest | str | None = None) -> int:
        """Queue a request; returns its number of prompt tokens.

        ``output_kind`` says what ``step()`` reports for it (see ``output_processor``): "cumulative"
        (the whole output each step), "delta" (what is new each step) or "final" (once, finished).
        ``final_only=True`` is the older spelling of ``output_kind="final"``. ``priority`` orders
        admission under ``scheduling_policy="priority"`` (lower first); under "fcfs" only 0 is taken,
        as in vLLM. Sampling fields ``params`` leaves unset take the model's generation defaults.
        ``tenant`` (a name and a weight) shares the engine fairly between tenants when it is
        saturated (``fair_share``); requests without one share the default tenant. ``lora_request``
        (a ``LoRARequest``, or a loaded adapter's name) runs it with that LoRA adapter.
        Whatever is wrong with the request raises here, typed (``podium.errors``): a ``ChatPrompt`` the
        template rejects, a prompt (plus an explicit ``max_tokens``) longer than the context.
        """
        if priority != 0 and self.config.scheduling_policy != "priority":
            raise InvalidParameter(f"priority={priority} needs scheduling_policy='priority' (--scheduling-policy priority); "
                             f"this engine runs {self.config.scheduling_policy}", param="priority")
        if self.pooler is not None or isinstance(params, PoolingParams):
            if lora_request is not None:
                raise InvalidParameter("LoRA adapters are served for text generation, not embeddings",
                                       param="lora_request")
            return self._add_pooling_request(request_id, prompt, params, arrival_time, priority, tenant)
        lora = self._adapter(lora_request)
        params = params or SamplingParams()
        requested_max_tokens = params.max_tokens  # the caller's: a generation_config default is no request
        grammar = None
        if params.structured_outputs is not None:  # checked now; compiled in the background
            grammar = self.grammars.request(params.structured_outputs)
        if self.sampling_defaults:
            params = with_fallbacks(params, self.sampling_defaults)
        bound_to_vocab(params, self.sampler.vocab_size)
        if final_only:
            output_kind = "final"
        if output_kind not in OUTPUT_KINDS:
            raise ValueError(f"output_kind must be one of {', '.join(OUTPUT_KINDS)}, got {output_kind!r}")
        if request_id in self._requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        text, ids = self.encode_prompt(prompt)
        if not ids:
            raise InvalidParameter("the prompt is empty; give at least one token", param="prompt")
        check_context(self.max_model_len, len(ids), requested_max_tokens)
        arrival = time.time() if arrival_time is None else arrival_time
        if tenant is not None and not isinstance(tenant, Tenant):
            raise ValueError(f"tenant must be a podium.Tenant, got {type(tenant).__name__}")
        seqs = [Sequence(next(self._seq_ids), request_id, i, ids, params, arrival, priority,
                         tenant=tenant or DEFAULT_TENANT, grammar=grammar, lora=lora) for i in range(params.n)]
        self._requests[request_id] = RequestState(request_id, text, ids, [self.processor.new_state(s) for s in seqs],
                                                  RequestMetrics(arrival_time=arrival), output_kind=output_kind)
        if self.speculator is not None:
            self.speculator.add(seqs, params.prediction, self.tokenizer)
        for seq in seqs:
            if grammar is not None and not grammar.done():
                self._compiling.append(seq)
            else:
                self.scheduler.add(seq)
        return len(ids)

    def _add_pooling_request(self, request_id: str, prompt: str | list[int], params: PoolingParams | None,
                             arrival_time: float | None, priority: int, tenant: Tenant | None) -> int:
        """Queue an embedding request (see ``pooling_step``), reported once, finished, whatever the
        output kind; returns its number of input tokens. InvalidParameter naming what is wrong."""
        if self.pooler is None:
            raise InvalidParameter(f"model {self.model_name!r} generates text; it computes no embeddings. Start it "
                                   "with runner='pooling' (--runner pooling) to serve embeddings", param="model")
        params = PoolingParams() if params is None else params
        if not isinstance(params, PoolingParams):
            raise InvalidParameter(f"model {self.model_name!r} is an embedding (pooling) model: it computes embeddings, "
                                   "not text. Use LLM.embed / LLM.encode or POST /v1/embeddings", param="model")
        if request_id in self._requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        self.pooler.check(params, self.model_name)
        text, ids = self.encode_prompt(prompt, param="input")
        if not ids:
            raise InvalidParameter("the input is empty; give at least one token", param="input")
        if len(ids) > self.max_model_len:
            raise PromptTooLong(f"This model's maximum context length is {self.max_model_len} tokens, but the input "
                                f"has {len(ids)} tokens. Please shorten the input.", len(ids), self.max_model_len,
                                param="input")
        if tenant is not None and not isinstance(tenant, Tenant):
            raise ValueError(f"tenant must be a podium.Tenant, got {type(tenant).__name__}")
        arrival = time.time() if arrival_time is None else arrival_time
        self._requests[request_id] = PoolingRequest(request_id, text, ids, params, RequestMetrics(arrival_time=arrival))
        self.scheduler.add(Sequence(next(self._seq_ids), request_id, 0, ids, params, arrival, priority,
                                    tenant=tenant or DEFAULT_TENANT))
        return len(ids)

    def _admit_compiled(self, several: dict[str, RequestState]) -> None:
        """Queue the sequences whose grammar has compiled; end those whose compilation failed. When
        nothing else can run, wait a moment for the oldest compilation instead of spinning."""
        if not self.scheduler.has_unfinished() and self._in_flight is None:
            futures.wait([self._compiling[0].grammar], timeout=0.005)
        waiting = []
        for seq in self._compiling:
            if not seq.grammar.done():
                waiting.append(seq)
            elif seq.grammar.exception() is not None:
                logger.error("request %s: its grammar did not compile: %s", seq.request_id, seq.grammar.exception())
                self._fail_uncompiled(seq, several)
            else:
                self.scheduler.add(seq)
        self._compiling = waiting

    def _fail_uncompiled(self, seq: Sequence, several: dict[str, RequestState]) -> None:
        seq.status, seq.finish_reason = _FINISHED, "abort"
        req = self._requests.get(seq.request_id)
        if req is not None:
            several[seq.request_id] = req

    def abort_request(self, request_id: str | Seq[str]) -> None:
        for rid in [request_id] if isinstance(request_id, str) else request_id:
            if self._requests.pop(rid, None) is None:
                continue
            self._compiling = [s for s in self._compiling if s.request_id != rid]
            for seq in self.scheduler.abort(rid):
                self._forget(seq)

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests)

    def has_step_in_flight(self) -> bool:
        """Whether a launched step's tokens are still unread (async scheduling): the next
        ``step()`` reports them even if it schedules nothing new."""
        return self._in_flight is not None

    def _forget(self, seq: Sequence) -> None:
        self.sampler.forget(seq.seq_id)
        if self.speculator is not None:
            self.speculator.forget(seq)

    # -- the step ------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one step; returns the reports of the requests it changed (see ``output_kind``).

        The hot path: one pass over the sampled tokens appends each, checks its stop rules and,
        for a single-sample request, builds its report while its state is still in cache. With
        async scheduling the tokens reported are those of the step launched by the previous call.

        A step that raises never ends the engine (see ``_recover``): a ``StepFault`` aborts the one
        request it names; any other exception fails the requests of that step. Either way the
        reports say so (``RequestOutput.error``) and the others go on. Only ``EngineDead`` (or
        ``MAX_CONSECUTIVE_FAULTS`` failed steps in a row) propagates.
        """
        outputs: list[RequestOutput] = []
        self._step_work = None
        try:
            outputs = self._step(outputs)
        except EngineDead:
            raise
        except Exception as exc:
            return outputs + self._recover(exc)
        self._consecutive_faults = 0
        return outputs

    def _step(self, outputs: list[RequestOutput]) -> list[RequestOutput]:
        started = time.perf_counter()
        if self.tp is not None:
            self.tp.check()  # a worker that died between steps: EngineDead before planning
        if self.pooler is not None:
            return self._pooling_step(started)
        several: dict[str, RequestState] = {}  # requests reported after the pass (n > 1, or ended early)
        if self._compiling:
            self._admit_compiled(several)
        previous, self._in_flight = self._in_flight, None
        if self.speculator is not None:
            self.speculator.propose(self.scheduler.running(), self.max_model_len)
        plan = self.scheduler.schedule()
        self._step_work = (plan, previous)  # what a fault in this step fails (kept as is: no cost per step)
        if self.fault_injector is not None:
            self.fault_injector(plan)
        for seq in plan.finished:  # sequences the scheduler ended itself (could never fit)
            self._forget(seq)
            if seq.request_id in self._requests:
                several[seq.request_id] = self._requests[seq.request_id]
        launched = None
        if plan.scheduled:
            now = time.time()
            defer = self.async_scheduling and self._can_defer(plan)
            if self.speculator is not None:
                with self.grad_off():
                    self.speculator.draft(plan)
            launched = self._run(plan, previous, defer)
            for seq in plan.admitted:
                req = self._requests.get(seq.request_id)
                if req is not None and req.metrics.first_scheduled_time is None:
                    req.metrics.first_scheduled_time = now
            if defer:
                self._add_placeholders(launched)
        if previous is not None:  # wait for the previous step's tokens while this one runs
            self._take_tokens(previous.result(), previous.indices, outputs, several)
        if isinstance(launched, VerifyStep):  # book the tokens first: advance counts the accepted drafts
            self._take_verified(launched, plan, outputs, several)
            self.scheduler.advance(plan)
            self._observe(plan)
            self._count_step(plan, time.perf_counter() - started)
        elif launched is not None:
            self.scheduler.advance(plan)
            if isinstance(launched, LaunchedStep):
                self._in_flight = launched
            else:
                for seq_id, entries in launched.prompt_logprobs.items():
                    self._add_prompt_logprobs(seq_id, entries, plan)
                self._take_tokens(launched, None, outputs, several)
                self._observe(plan)
            self._count_step(plan, time.perf_counter() - started)
        return self._collect(several, outputs)

    # -- faults ----------------------------------------------------------------------------------
    def _recover(self, exc: Exception) -> list[RequestOutput]:
        """A step raised: fail the request it names (``StepFault``) or, when it names none, every
        request of the step (all running ones if it failed while planning); then rebuild the
        scheduler and block state as if every other sequence had been preempted (it recomputes, so
        greedy and seeded outputs are unchanged) and go on. Returns the failed requests' reports."""
        self._in_flight = None  # an unread async step: its tokens are sampled again
        if isinstance(exc, StepFault) and exc.request_id in self._requests:
            culprits, message = {exc.request_id}, f"request failed inside the engine: {exc}"
            logger.warning("step fault pinned to request %s: %s", exc.request_id, exc)
        else:
            self._consecutive_faults += 1
            if self._consecutive_faults >= MAX_CONSECUTIVE_FAULTS:
                raise EngineDead(f"{self._consecutive_faults} engine steps in a row failed; last: "
                                 f"{type(exc).__name__}: {exc}") from exc
            culprits = self._step_culprits()
            message = f"the engine step serving this request failed: {type(exc).__name__}: {exc}"
            logger.error("engine step failed (%d requests in it fail, the others go on)", len(culprits),
                         exc_info=exc)
        for seq in self.scheduler.reset():
            self.sampler.forget(seq.seq_id)  # its penalty counts may be half-updated: rebuilt when next sampled
        self.block_manager.release_all()
        return [self._fail_request(rid, message) for rid in sorted(culprits) if rid in self._requests]

    def _step_culprits(self) -> set[str]:
        """The requests of the failed step: those planned, and those of the step in flight before it
        (all running ones if it failed while planning)."""
        if self._step_work is None:
            return {seq.request_id for seq in self.scheduler.running()}
        plan, previous = self._step_work
        culprits = {s.seq.request_id for s in plan.scheduled}
        if previous is not None:
            culprits.update(seq.request_id for seq in previous.seqs)
        return culprits

    def _fail_request(self, request_id: str, message: str) -> RequestOutput | PoolingRequestOutput:
        req = self._requests.pop(request_id)
        for seq in self.scheduler.abort(request_id, reason="error"):
            self._forget(seq)
        if isinstance(req, PoolingRequest):
            return failed_output(req, message)
        output = self.processor.build_output(req)
        output.error = message
        return output

    def _pooling_step(self, started: float) -> list:
        """A pooling model's step: whole inputs in, their embeddings out (``pooling_step``)."""
        plan = self.scheduler.schedule()
        self._step_work = (plan, None)  # what a fault in this step fails
        if self.fault_injector is not None:
            self.fault_injector(plan)
        for seq in plan.finished:  # cannot fit at all (refused at add_request, so only a smaller cache)
            logger.error("input of request %s (%d tokens) can never fit the scheduler; dropped", seq.request_id,
                         seq.num_tokens)
            self._requests.pop(seq.request_id, None)
        if not plan.scheduled:
            return []
        outputs = pooling_step(plan, self.runner, self.pooler, self._requests, self.scheduler, self.grad_off)
        self._prefill_tokens += plan.num_batched_tokens
        self._prefill_seconds += time.perf_counter() - started
        return outputs

    def _count_step(self, plan, seconds: float) -> None:
        """Book a step for a router's estimates: a step of decodes only (one token each) as a decode
        step; otherwise its prompt tokens and their share of its time, by token count."""
        if plan.num_batched_tokens == len(plan.scheduled):
            self._decode_steps += 1
            self._decode_seconds += seconds
            return
        prompt = sum(s.num_new_tokens for s in plan.scheduled if s.start < s.seq.num_prompt_tokens)
        if not prompt:  # decodes verifying speculative drafts
            self._decode_steps += 1
            self._decode_seconds += seconds
            return
        self._prefill_tokens += prompt
        self._prefill_seconds += seconds * prompt / plan.num_batched_tokens


    def _run(self, output: SchedulerOutput, previous: LaunchedStep | None,
             defer: bool) -> StepResult | LaunchedStep | VerifyStep:
        """Execute the scheduler's plan on the device and sample: now, or deferred (``defer``), in
        which case the tokens stay on the device until the next step reads them."""
        plan = plan_step(output, previous.rows if previous is not None else None)
        feed = previous.tokens if previous is not None else None
        with self.grad_off():
            if self.tp is None:
                step = self.runner.execute(plan, feed)
            else:  # every rank runs the same plan; the collectives inside keep them in step
                with self.tp.guard():
                    self.tp.send_step(plan, feed)
                    step = self.runner.execute(plan, feed)
            self._kept_hidden = step.hidden
            seqs = [output.scheduled[i].seq for i in plan.samples]
            pending = previous.tokens_by_seq if previous is not None else None
            if defer:
                return launch(self.sampler, step.logits, seqs, step.num_tokens, step.used_graph, self.device, pending)
            prompt = prompt_logprobs(self.sampler, output, plan, step.prompt_logits) if plan.prompt_spans else {}
            if plan.sample_drafts:
                items = [output.scheduled[i] for i in plan.samples]
                return VerifyStep(step.logits, seqs, [s.drafts for s in items], items, prompt, step.num_tokens)
            return sample_now(self.sampler, step.logits, seqs, prompt, step.num_tokens, step.used_graph, pending)

    # -- speculative decoding --------------------------------------------------------------------
    def _observe(self, plan: SchedulerOutput) -> None:
        """The drafter sees the booked step (an EAGLE head mirrors the target's kept hidden states)."""
        if self.speculator is not None:
            hidden, self._kept_hidden = self._kept_hidden, None
            with self.grad_off():
                self.speculator.observe(plan, hidden)

    def _take_verified(self, step: VerifyStep, plan: SchedulerOutput, outputs: list[RequestOutput],
                       several: dict[str, RequestState]) -> None:
        """Verify the drafts round by round (``spec.verify``), booking each round's tokens; a
        request with drafts is reported once, after every round."""
        for seq_id, entries in step.prompt_logprobs.items():
            self._add_prompt_logprobs(seq_id, entries, plan)
        for seq, drafts in zip(step.seqs, step.drafts):
            if drafts and seq.request_id in self._requests:
                several[seq.request_id] = self._requests[seq.request_id]

        def book(seqs: list[Sequence], sampled, position: int) -> None:
            result = StepResult(list(zip(seqs, sampled.token_ids)), sampled.logprobs, {}, step.num_tokens, False)
            self._take_tokens(result, None, outputs, several)

        with self.grad_off():
            accepted = verify(self.sampler, step.logits, step.seqs, step.drafts, book)
        for item, drafts, count in zip(step.items, step.drafts, accepted):
            if drafts:
                item.num_accepted = count
                self.speculator.record(len(drafts), count)

    def _can_defer(self, plan: SchedulerOutput) -> bool:
        seqs = []
        for s in plan.scheduled:
            if s.seq.params.prompt_logprobs is not None:
                return False
            if s.samples:
                seqs.append(s.seq)
        # (a verify step samples its drafts on the host: constrained rows stay out of deferral with a proposer)
        return self.sampler.can_defer(seqs, grammars=self.speculator is None)

    def _add_placeholders(self, launched: LaunchedStep) -> None:
        """Give each sequence of an in-flight step a placeholder for its token, unless that token
        ends it by length (then the next step has nothing to compute for it)."""
        room = min(self.max_model_len, self.block_manager.capacity_tokens)
        indices = launched.indices
        for seq in launched.seqs:
            token_ids = seq.token_ids
            indices.append(len(token_ids))
            max_tokens = seq.params.max_tokens
            if len(token_ids) + 1 >= room or (
                    max_tokens is not None and len(token_ids) + 1 - len(seq.prompt_token_ids) >= max_tokens):
                continue
            token_ids.append(-1)
            seq.num_pending_tokens += 1

    def _take_tokens(self, result: StepResult, indices: list[int] | None, outputs: list[RequestOutput],
                     several: dict[str, RequestState]) -> None:
        """Book a step's sampled tokens: append (or fill placeholders), stop rules, reports."""
        done = time.time()
        requests, append, build, scheduler = self._requests, self.processor.append, self.processor.build_output, \
            self.scheduler
        for i, ((seq, token), logprobs) in enumerate(zip(result.sampled, result.logprobs)):
            if seq.status is _FINISHED:  # aborted, or ended by the previous step while this one ran
                continue
            req = requests[seq.request_id]
            sequences = req.sequences
            finish = append(sequences[seq.sample_index], token, logprobs, indices[i] if indices is not None else None)
            metrics = req.metrics
            if metrics.first_token_time is None:
                metrics.first_token_time = done
                metrics.num_cached_prompt_tokens = seq.num_cached_tokens
            metrics.last_token_time = done
            if finish is not None:
                scheduler.finish(seq, *finish)
                self._forget(seq)
            if len(sequences) > 1 or (several and seq.request_id in several):
                several[seq.request_id] = req
            elif finish is not None:
                outputs.append(build(req))
                del requests[seq.request_id]
            elif req.output_kind != "final":
                outputs.append(build(req))

    def _collect(self, changed: dict[str, RequestState], outputs: list[RequestOutput]) -> list[RequestOutput]:
        build = self.processor.build_output
        for rid, req in changed.items():
            finished = req.finished
            if not finished and req.output_kind == "final":
                continue
            req.metrics.num_cached_prompt_tokens = req.sequences[0].seq.num_cached_tokens
            outputs.append(build(req))
            if finished:
                del self._requests[rid]
        return outputs

    def _add_prompt_logprobs(self, seq_id: int, entries: list, plan) -> None:
        for s in plan.scheduled:
            if s.seq.seq_id == seq_id:
                req = self._requests[s.seq.request_id]
                req.prompt_logprobs = (req.prompt_logprobs or []) + entries
                return

    # -- LoRA adapters (podium.lora) ------------------------------------------------------------
    def _adapter(self, lora_request: LoRARequest | str | None) -> AdapterRef | None:
        if lora_request is None:
            return None
        return self._lora_registry("lora_request").resolve(lora_request)

    def _lora_registry(self, param: str = "lora_request") -> AdapterRegistry:
        if self.loras is None:
            raise InvalidParameter("this engine serves no LoRA adapters; start it with enable_lora=True "
                                   "(--enable-lora)", param=param)
        return self.loras

    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Register an adapter (read and checked now); True. vLLM's name for it."""
        self._lora_registry().add(lora_request)
        return True

    def remove_lora(self, lora_id: int) -> bool:
        """Forget the adapter of id ``lora_id``; False if none has it. Accepted requests finish with it."""
        ref = next((r for r in self.lora_adapters() if r.lora_int_id == lora_id), None)
        if ref is not None:
            self.loras.remove(ref.name)
        return ref is not None

    def list_loras(self) -> set[int]:
        return {ref.lora_int_id for ref in self.lora_adapters()}

    def load_lora(self, name: str, path: str) -> AdapterRef:
        """Register adapter ``name`` from folder ``path`` with an id of its own (the server's load endpoint)."""
        return self._lora_registry("lora_name").load(name, path)

    def unload_lora(self, name: str) -> AdapterRef:
        """Forget adapter ``name`` (AdapterNotFound if it is not loaded)."""
        return self._lora_registry("lora_name").remove(name)

    def lora_adapters(self) -> list[AdapterRef]:
        """The adapters registered, in registration order (none where LoRA is off)."""
        return self.loras.adapters() if self.loras is not None else []

    # -- introspection -------------------------------------------------------------------------
    def stats(self) -> EngineStats:
        bm = self.block_manager
        return EngineStats(
            num_running=self.scheduler.num_running,
            num_waiting=self.scheduler.num_waiting + len(self._compiling),
            num_free_blocks=bm.num_free_blocks,
            num_total_blocks=self.num_kv_blocks,
            kv_cache_usage=bm.usage,
            prefix_cache_queries=bm.prefix_cache_queries,
            prefix_cache_hits=bm.prefix_cache_hits,
            num_preemptions=self.scheduler.num_preemptions,
            queued_tokens=self.scheduler.queued_tokens(),
            running_tokens=self.scheduler.running_tokens(),
            prefill_tokens=self._prefill_tokens,
            prefill_seconds=self._prefill_seconds,
            decode_steps=self._decode_steps,
            decode_seconds=self._decode_seconds,
            spec_decoding=self.speculator.stats.copy() if self.speculator is not None else None,
        )

    # -- KV events -----------------------------------------------------------------------------
    @property
    def block_hash_scheme(self) -> str | None:
        """The prefix cache's block hash scheme (None when prefix caching is off)."""
        return BLOCK_HASH_SCHEME if self.block_manager.enable_prefix_caching else None

    def block_hash_extra(self, lora: AdapterRef) -> str:
        """The text the prefix cache's block hashes digest after the token ids for requests with adapter
        ``lora`` (a server reports it, so that a router hashes such a request as this engine does)."""
        return extra_keys_text(adapter_extra_keys(lora))

    def enable_kv_events(self) -> list[int]:
        """Start recording the prefix cache's stored/evicted block hashes (``BlockManager``'s chained
        hash); returns the hashes cached now. A server does this for a router (podium_server.replica)."""
        return self.block_manager.enable_events()

    def take_kv_events(self) -> list[tuple[str, int]]:
        """``("stored" | "evicted", block hash)`` events since the last call, in order."""
        return self.block_manager.take_events()

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            chat_template: str | None = None, tools: list[dict] | None = None,
                            continue_final_message: bool = False, **template_kwargs: Any) -> list[int]:
        """Token ids of ``messages`` through the model's chat template, or ``chat_template`` (a
        template's text or a file holding one); ``tools`` and ``template_kwargs`` are the template's
        variables (a template that uses no such variable ignores them)."""
        return render_chat(self.tokenizer, ChatPrompt(messages, add_generation_prompt, continue_final_message,
                                                      chat_template, tools, template_kwargs), self.model_name)

