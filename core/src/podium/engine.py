"""``LLMEngine``: requests in, tokens out, one ``step()`` at a time.

Startup: choose the platform -> resolve the model -> build it on the device -> size and allocate
the KV cache -> capture decode graphs where the platform can. A step: the scheduler plans, the
runner executes the plan, the scheduler advances computed tokens, the output processor appends
sampled tokens and finishes sequences. Everything platform-specific goes through the platform.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence as Seq
from dataclasses import dataclass

import torch

from podium_plugin_api import AttentionMetadata
from podium_plugin_api.ops import build_op_table

from .block_manager import BlockManager
from .config import EngineConfig
from .discovery import build_plugin_manager, select_platform
from .kv_cache import kv_cache_bytes, kv_cache_spec, num_kv_blocks, profile_activation_bytes
from .loader import resolve_model
from .model_runner import ModelRunner, grad_off
from .models.context import ForwardContext
from .models.registry import build_model, init_random_weights
from .output_processor import OutputProcessor, RequestState
from .outputs import RequestMetrics, RequestOutput
from .request import Sequence
from .sampler import Sampler
from .sampling_params import SamplingParams
from .scheduler import Scheduler

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class EngineStats:
    num_running: int
    num_waiting: int
    num_free_blocks: int
    num_total_blocks: int
    kv_cache_usage: float
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_preemptions: int


def context_error(max_model_len: int, prompt_len: int) -> str:
    return (
        f"This model's maximum context length is {max_model_len} tokens, but the prompt has {prompt_len} "
        f"tokens (at least one token must be left to generate). Please shorten the prompt."
    )


class LLMEngine:
    def __init__(self, config: EngineConfig | None = None, **kwargs) -> None:
        t0 = time.perf_counter()
        config = config if config is not None else EngineConfig.from_kwargs(**kwargs)
        entry = select_platform(config.device)
        self.platform = platform = entry.platform
        self.platform_name = entry.name
        self.config = config = config.with_defaults(platform.config_defaults())
        pm, _ = build_plugin_manager()
        source = resolve_model(config.model, config.tokenizer)
        self.source, self.tokenizer = source, source.tokenizer
        self.model_name = config.served_model_name or config.model
        self.max_model_len = self._max_model_len(config, source.max_model_len)
        self.dtype = self._resolve_dtype(config.dtype, platform)
        self.device = platform.torch_device()
        platform.seed(config.seed)
        overrides: dict = {}
        for ops in pm.hook.podium_custom_ops(platform=platform):
            overrides.update(ops or {})
        extra_archs: dict = {}
        for archs in pm.hook.podium_model_architectures():
            extra_archs.update(archs or {})
        t1 = time.perf_counter()
        self.model = build_model(source.hf_config, build_op_table(overrides), self.dtype, self.device, extra_archs)
        weights = source.weights()
        if weights is None:
            init_random_weights(self.model, config.seed)
        else:
            self.model.load_weights(weights)
        self.model = platform.prepare_model(self.model.eval())  # device-specific transformations
        t2 = time.perf_counter()
        self._build_cache_and_runner(source)
        t3 = time.perf_counter()
        capture = 0.0
        if platform.capabilities().graph_capture and not config.enforce_eager:
            capture = self.runner.capture_graphs(config.max_num_seqs)
        self.startup_seconds = {"platform_and_model_files": t1 - t0, "weights": t2 - t1,
                                "kv_cache": t3 - t2, "graph_capture": capture,
                                "total": time.perf_counter() - t0}
        self.processor = OutputProcessor(self.tokenizer, source.eos_token_ids, self.max_model_len)
        self._requests: dict[str, RequestState] = {}
        self._seq_ids = itertools.count()

    # -- setup ---------------------------------------------------------------------------------
    @staticmethod
    def _max_model_len(config: EngineConfig, model_len: int) -> int:
        if config.max_model_len is None:
            return model_len
        if config.max_model_len > model_len:
            raise ValueError(f"max_model_len={config.max_model_len} exceeds the model's context length {model_len}")
        return config.max_model_len

    @staticmethod
    def _resolve_dtype(name: str, platform) -> torch.dtype:
        caps = platform.capabilities()
        dtype = caps.default_dtype if name == "auto" else _DTYPES[name]
        if dtype not in caps.dtypes:
            supported = ", ".join(str(d).replace("torch.", "") for d in caps.dtypes)
            raise ValueError(f"platform {platform.name!r} does not support dtype {name}; it supports {supported}")
        return dtype

    def _build_cache_and_runner(self, source) -> None:
        config, platform = self.config, self.platform
        spec = kv_cache_spec(source.hf_config, config.block_size, self.dtype)
        activation = 0
        if platform.capabilities().kv_cache_from_free_memory and config.num_kv_blocks is None:
            activation = profile_activation_bytes(platform, lambda: self._profile_forward(spec))
        nbytes = 0 if config.num_kv_blocks else kv_cache_bytes(config, platform, activation)
        blocks = num_kv_blocks(config, spec, nbytes, self.max_model_len)
        self.num_kv_blocks, self.kv_capacity_tokens = blocks, blocks * config.block_size
        self.kv_caches = platform.allocate_kv_cache(spec, blocks)
        self.block_manager = BlockManager(blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs, config.token_budget, self.max_model_len)
        vocab = source.hf_config.vocab_size
        sample_on = torch.device("cpu") if platform.capabilities().static_shapes else self.device
        self.sampler = Sampler(vocab, sample_on, eos_token_ids=source.eos_token_ids, seed=config.seed)
        self.runner = ModelRunner(self.model, platform, self.kv_caches, self.sampler, config.block_size,
                                  config.max_num_seqs, self.max_model_len, self.device)

    def _profile_forward(self, spec) -> None:
        with grad_off(self.platform):
            self._profile_forward_inner(spec)

    def _profile_forward_inner(self, spec) -> None:
        """A forward pass at the largest batch the scheduler can form, into a throwaway cache."""
        tokens = min(self.config.token_budget, self.config.max_num_seqs * self.max_model_len)
        seq_len = min(self.max_model_len, tokens)
        lens = [seq_len] * (tokens // seq_len) + ([tokens % seq_len] if tokens % seq_len else [])
        bs = spec.block_size
        tables, next_block = [], 0
        for n in lens:
            tables.append(list(range(next_block, next_block + -(-n // bs))))
            next_block += len(tables[-1])
        caches = self.platform.allocate_kv_cache(spec, next_block)
        backend = self.platform.attention_backend()
        meta = backend.prepare_metadata(AttentionMetadata.from_lengths(lens, lens, tables, bs, self.device))
        ids = torch.zeros(tokens, dtype=torch.long, device=self.device)
        positions = torch.cat([torch.arange(n, device=self.device) for n in lens])
        hidden = self.model(ids, positions, ForwardContext(meta, caches, backend))
        self.model.compute_logits(hidden[: min(tokens, self.config.max_num_seqs)])
        del caches, hidden

    # -- requests ------------------------------------------------------------------------------
    def encode_prompt(self, prompt: str | list[int]) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this model has no tokenizer; pass prompt token ids instead of text")
            return prompt, self.tokenizer.encode(prompt)
        ids = [int(t) for t in prompt]
        vocab = self.source.hf_config.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token ids must be in [0, {vocab}); got {bad[:5]}")
        return None, ids

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams | None = None,
                    arrival_time: float | None = None, priority: int = 0, final_only: bool = False) -> None:
        """Queue a request. ``final_only``: step() reports it once, finished (no per-token outputs)."""
        params = params or SamplingParams()
        if request_id in self._requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        text, ids = self.encode_prompt(prompt)
        if not ids:
            raise ValueError("the prompt is empty; give at least one token")
        if len(ids) >= self.max_model_len:
            raise ValueError(context_error(self.max_model_len, len(ids)))
        arrival = time.time() if arrival_time is None else arrival_time
        seqs = [Sequence(next(self._seq_ids), request_id, i, ids, params, arrival, priority) for i in range(params.n)]
        self._requests[request_id] = RequestState(request_id, text, ids, [self.processor.new_state(s) for s in seqs],
                                                  RequestMetrics(arrival_time=arrival), final_only=final_only)
        for seq in seqs:
            self.scheduler.add(seq)

    def abort_request(self, request_id: str | Seq[str]) -> None:
        for rid in [request_id] if isinstance(request_id, str) else request_id:
            if self._requests.pop(rid, None) is None:
                continue
            for seq in self.scheduler.abort(rid):
                self._forget(seq)

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests)

    def _forget(self, seq: Sequence) -> None:
        self.runner.release(seq)
        self.sampler.forget(seq.seq_id)

    # -- the step ------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        plan = self.scheduler.schedule()
        for seq in plan.preempted:
            self.runner.release(seq)
        changed: dict[str, RequestState] = {}
        for seq in plan.finished:  # sequences the scheduler ended itself (could never fit)
            self._forget(seq)
            if seq.request_id in self._requests:
                changed[seq.request_id] = self._requests[seq.request_id]
        if not plan.scheduled:
            return self._collect(changed)
        now = time.time()
        result = self.runner.execute(plan)
        self.scheduler.advance(plan)
        for s in plan.scheduled:
            req = self._requests.get(s.seq.request_id)
            if req is not None and req.metrics.first_scheduled_time is None:
                req.metrics.first_scheduled_time = now
        for seq_id, entries in result.prompt_logprobs.items():
            self._add_prompt_logprobs(seq_id, entries, plan)
        done = time.time()
        for (seq, token), logprobs in zip(result.sampled, result.logprobs):
            req = self._requests[seq.request_id]
            state = req.sequences[seq.sample_index]
            finish = self.processor.append(state, token, logprobs)
            if req.metrics.first_token_time is None:
                req.metrics.first_token_time = done
            req.metrics.last_token_time = done
            if finish is not None:
                self.scheduler.finish(seq, *finish)
                self._forget(seq)
            changed[seq.request_id] = req
        return self._collect(changed)

    def _collect(self, changed: dict[str, RequestState]) -> list[RequestOutput]:
        outputs = []
        for rid, req in changed.items():
            if req.final_only and not req.finished:
                continue
            req.metrics.num_cached_prompt_tokens = req.sequences[0].seq.num_cached_tokens
            outputs.append(self.processor.build_output(req))
            if req.finished:
                del self._requests[rid]
        return outputs

    def _add_prompt_logprobs(self, seq_id: int, entries: list, plan) -> None:
        for s in plan.scheduled:
            if s.seq.seq_id == seq_id:
                req = self._requests[s.seq.request_id]
                req.prompt_logprobs = (req.prompt_logprobs or []) + entries
                return

    # -- introspection -------------------------------------------------------------------------
    def stats(self) -> EngineStats:
        bm = self.block_manager
        return EngineStats(
            num_running=self.scheduler.num_running,
            num_waiting=self.scheduler.num_waiting,
            num_free_blocks=bm.num_free_blocks,
            num_total_blocks=self.num_kv_blocks,
            kv_cache_usage=bm.usage,
            prefix_cache_queries=bm.prefix_cache_queries,
            prefix_cache_hits=bm.prefix_cache_hits,
            num_preemptions=self.scheduler.num_preemptions,
        )

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
        if self.tokenizer is None or not getattr(self.tokenizer, "chat_template", None):
            raise ValueError(f"model {self.model_name!r} has no chat template; use completions with a plain prompt")
        ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=True)
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
        return list(ids)
