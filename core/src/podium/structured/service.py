"""``GrammarService``: compiled grammars, built off the step path and cached.

``request(params)`` checks the constraint on the caller's thread (a bad schema or regex raises
``InvalidParameter`` at once) and returns a ``concurrent.futures.Future`` of the compiled grammar:
already done on a cache hit, else running in the service's worker thread. The engine keeps a
request out of the scheduler until its future is done, so a step never waits for a compilation.

The cache key is (backend, spec); one service serves one tokenizer (its engine's), so together with
the service that is (backend, spec, tokenizer). Entries are evicted least recently used first.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from ..config import STRUCTURED_OUTPUTS_BACKENDS as BACKENDS
from ..errors import InvalidParameter
from ..sampling_params import StructuredOutputsParams
from .backend import GrammarBackend, GrammarSpec, Matcher


def make_backend(name: str, tokenizer: Any, vocab_size: int, eos_token_ids: list[int]) -> GrammarBackend:
    # A config may name end ids past the logits' width (a shape config over a smaller tokenizer); the model
    # cannot sample them, and llguidance refuses them outright.
    eos_token_ids = [i for i in eos_token_ids if 0 <= i < vocab_size]
    if name == "xgrammar":
        from .xgrammar_backend import XGrammarBackend
        return XGrammarBackend(tokenizer, vocab_size, eos_token_ids)
    if name == "llguidance":
        from .llguidance_backend import LLGuidanceBackend
        return LLGuidanceBackend(tokenizer, vocab_size, eos_token_ids)
    raise InvalidParameter(f"unknown structured output backend {name!r}; choose one of {', '.join(BACKENDS)}",
                           param="backend")


class CompiledGrammar:
    """A compiled grammar and the backend that makes its matchers."""

    def __init__(self, backend: GrammarBackend, compiled: Any) -> None:
        self.backend, self.compiled = backend, compiled

    def matcher(self) -> Matcher:
        return self.backend.matcher(self.compiled)


class GrammarService:
    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: list[int], default_backend: str = "xgrammar",
                 cache_size: int = 256) -> None:
        if default_backend not in BACKENDS:
            raise ValueError(f"structured_outputs_backend must be one of {', '.join(BACKENDS)}, got {default_backend!r}")
        self.tokenizer, self.vocab_size, self.eos_token_ids = tokenizer, vocab_size, list(eos_token_ids)
        self.default_backend = default_backend
        self.cache_size = cache_size
        self._backends: dict[str, GrammarBackend] = {}
        self._cache: OrderedDict[tuple[str, GrammarSpec], Future] = OrderedDict()
        self._lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None  # started on the first constrained request
        self.compilations = 0  # grammars compiled (cache misses), for tests and benchmarks

    def backend(self, name: str | None) -> GrammarBackend:
        name = name or self.default_backend
        backend = self._backends.get(name)
        if backend is None:
            if self.tokenizer is None:
                raise InvalidParameter("structured output needs the model's tokenizer; this model has none",
                                       param="structured_outputs")
            backend = self._backends[name] = make_backend(name, self.tokenizer, self.vocab_size, self.eos_token_ids)
        return backend

    def request(self, params: StructuredOutputsParams) -> Future:
        """The future compiled grammar of ``params`` (raises ``InvalidParameter`` for a bad one)."""
        spec = GrammarSpec.from_params(params)
        backend = self.backend(params.backend)
        key = (backend.name, spec)
        with self._lock:
            future = self._cache.get(key)
            if future is not None and not (future.done() and future.exception() is not None):
                self._cache.move_to_end(key)
                return future
        backend.validate(spec)
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="podium-grammar")
            future = self._pool.submit(self._compile, backend, spec)
            self._cache[key] = future
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        return future

    def _compile(self, backend: GrammarBackend, spec: GrammarSpec) -> CompiledGrammar:
        self.compilations += 1
        return CompiledGrammar(backend, backend.compile(spec))

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
