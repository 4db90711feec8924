"""Podium's offline ``LLM`` as a benchmark backend: prompt token ids in, greedy, EOS ignored."""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from .datasets import BenchRequest, TokenSpace
from .metrics import ThroughputResult

WARMUP_PROMPTS, WARMUP_INPUT_LEN, WARMUP_OUTPUT_LEN, WARMUP_SEED = 16, 16, 8, 987_654_321


class PodiumBackend:
    name = "podium"

    def __init__(self, llm: Any, detokenize: bool = True) -> None:
        self.llm = llm
        self.engine = llm.engine
        self.detokenize = detokenize and self.engine.tokenizer is not None

    @classmethod
    def create(cls, detokenize: bool = True, **engine_kwargs: Any) -> PodiumBackend:
        """Build ``LLM(**engine_kwargs)`` (the model among them); what is not given keeps the engine's defaults."""
        from podium.llm import LLM

        return cls(LLM(**engine_kwargs), detokenize)

    def token_space(self) -> TokenSpace:
        source = self.engine.source
        config = source.hf_config
        specials = list(source.eos_token_ids or []) + [getattr(config, "bos_token_id", None)]
        return TokenSpace.build(config.vocab_size, self.engine.max_model_len, self.engine.tokenizer, specials)

    @property
    def dtype(self):
        return self.engine.dtype

    @property
    def device(self):
        return self.engine.device

    def _params(self, output_len: int):
        from podium.sampling_params import SamplingParams

        return SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True, detokenize=self.detokenize)

    def generate(self, requests: list[BenchRequest], progress: bool = False) -> list:
        prompts = [{"prompt_token_ids": list(r.prompt_token_ids)} for r in requests]
        params = [self._params(r.output_len) for r in requests]
        outputs = self.llm.generate(prompts, params, use_tqdm=progress)
        self.engine.platform.synchronize()
        return outputs

    def warmup(self, requests: list[BenchRequest] | None = None) -> None:
        """An untimed generate shaped like the benchmark's first requests (their prompt lengths, a
        few output tokens) on prompts that share nothing with them (no cache hits), so the kernels
        and shapes the run needs are compiled before the clock starts."""
        space = self.token_space()
        allowed = space.allowed_ids()
        rng = np.random.default_rng(WARMUP_SEED)
        lengths = sorted((len(r.prompt_token_ids) for r in requests or ()), reverse=True)[:WARMUP_PROMPTS]
        lengths = lengths or [WARMUP_INPUT_LEN] * 2
        limit = max(1, space.max_model_len - WARMUP_OUTPUT_LEN - 1)
        warm = [BenchRequest(tuple(int(t) for t in rng.choice(allowed, min(n, limit))), WARMUP_OUTPUT_LEN)
                for n in lengths]
        self.generate(warm)

    def run(self, requests: list[BenchRequest], progress: bool = True) -> ThroughputResult:
        before = self.engine.stats()
        start = time.perf_counter()
        outputs = self.generate(requests, progress)
        elapsed = time.perf_counter() - start
        after = self.engine.stats()
        produced = sum(len(o.outputs[0].token_ids) for o in outputs)
        queries = after.prefix_cache_queries - before.prefix_cache_queries
        hits = after.prefix_cache_hits - before.prefix_cache_hits
        details = {
            "prefix_cache_hit_rate": hits / queries if queries else 0.0,
            "num_preemptions": after.num_preemptions - before.num_preemptions,
        }
        return ThroughputResult(self.name, elapsed, len(requests), sum(r.input_len for r in requests), produced,
                                details=details)
