"""Benchmark workloads: lists of requests (prompt token ids + how many tokens to generate).

Every synthetic dataset is a pure function of its :class:`DatasetSpec` (the seed included) and the
model's :class:`TokenSpace`, so two runs with the same arguments send exactly the same requests.
Synthetic prompts are random token ids that avoid the tokenizer's special tokens; EOS is ignored
when they are generated, so each request produces exactly ``output_len`` tokens.

- ``random``: lengths uniform in ``[len * (1 - r), len * (1 + r)]`` for ``--range-ratio r``.
- ``sharegpt-like``: lengths drawn from log-normal distributions with ShareGPT's shape (mean about
  200 prompt / 180 output tokens, a long right tail), clipped to the model's context.
- ``prefix-repetition``: ``--num-prefixes`` shared prefixes of ``--prefix-len`` tokens, each
  followed by a unique suffix of ``--suffix-len`` tokens (measures prefix caching).
- ``file``: a JSON list or JSONL file of ``{"prompt": str | [ids], "output_len": int}`` records.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

DATASETS = ("random", "sharegpt-like", "prefix-repetition", "file")

# ShareGPT-like length distributions: log-normal (mean, sigma of the underlying normal), clipped.
SHAREGPT_INPUT = (200.0, 1.0)
SHAREGPT_OUTPUT = (180.0, 0.8)
SHAREGPT_MIN_INPUT, SHAREGPT_MAX_INPUT = 4, 1024
SHAREGPT_MAX_OUTPUT = 1024


@dataclass(frozen=True)
class TokenSpace:
    """What a dataset needs from the model: the ids it may draw and the context length."""

    vocab_size: int
    max_model_len: int
    special_ids: frozenset[int] = frozenset()
    tokenizer: Any = None  # a Hugging Face tokenizer, or None (random shape models)

    def __post_init__(self) -> None:
        if self.vocab_size < 2:
            raise ValueError(f"vocab_size must be >= 2, got {self.vocab_size}")
        if self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")

    @classmethod
    def build(cls, vocab_size: int, max_model_len: int, tokenizer: Any = None, special_ids=()) -> TokenSpace:
        """Collect special ids from the tokenizer (if any) on top of ``special_ids``."""
        specials = {int(t) for t in special_ids if t is not None}
        if tokenizer is not None:
            specials.update(int(t) for t in getattr(tokenizer, "all_special_ids", []) or [])
            specials.update(int(t) for t in (getattr(tokenizer, "added_tokens_decoder", None) or {}))
            vocab_size = min(vocab_size, len(tokenizer))
        return cls(vocab_size, max_model_len, frozenset(t for t in specials if 0 <= t < vocab_size), tokenizer)

    def allowed_ids(self) -> np.ndarray:
        ids = np.arange(self.vocab_size, dtype=np.int64)
        if self.special_ids:
            ids = np.setdiff1d(ids, np.fromiter(self.special_ids, dtype=np.int64))
        return ids


@dataclass(frozen=True)
class BenchRequest:
    prompt_token_ids: tuple[int, ...]
    output_len: int
    prompt: str | None = None  # the original text, where the dataset had one

    @property
    def input_len(self) -> int:
        return len(self.prompt_token_ids)


@dataclass(frozen=True)
class DatasetSpec:
    name: str = "random"
    num_prompts: int = 100
    input_len: int = 1024
    output_len: int = 128
    range_ratio: float = 0.0
    prefix_len: int = 256
    suffix_len: int = 256
    num_prefixes: int = 10
    path: str | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        if self.name not in DATASETS:
            raise ValueError(f"dataset must be one of {', '.join(DATASETS)}, got {self.name!r}")
        for name in ("num_prompts", "input_len", "output_len", "num_prefixes"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        for name in ("prefix_len", "suffix_len"):
            if getattr(self, name) < 0:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 0, got {getattr(self, name)}")
        if not 0.0 <= self.range_ratio < 1.0:
            raise ValueError(f"--range-ratio must be in [0, 1), got {self.range_ratio}")
        if self.name == "file" and not self.path:
            raise ValueError("the file dataset needs --dataset-path (a JSON or JSONL file of prompts)")


def build_requests(spec: DatasetSpec, space: TokenSpace) -> list[BenchRequest]:
    """The request list ``spec`` describes, for a model with ``space``."""
    builders = {
        "random": random_requests,
        "sharegpt-like": sharegpt_like_requests,
        "prefix-repetition": prefix_repetition_requests,
        "file": file_requests,
    }
    return builders[spec.name](spec, space)


def _lengths(rng: np.random.Generator, center: int, ratio: float, n: int) -> np.ndarray:
    low = max(1, math.floor(center * (1.0 - ratio)))
    high = max(low, math.ceil(center * (1.0 + ratio)))
    return rng.integers(low, high + 1, size=n)


def _token_ids(rng: np.random.Generator, allowed: np.ndarray, n: int) -> tuple[int, ...]:
    return tuple(int(t) for t in allowed[rng.integers(0, len(allowed), size=n)])


def random_requests(spec: DatasetSpec, space: TokenSpace) -> list[BenchRequest]:
    longest = math.ceil(spec.input_len * (1 + spec.range_ratio)) + math.ceil(spec.output_len * (1 + spec.range_ratio))
    if longest > space.max_model_len:
        raise ValueError(
            f"--input-len {spec.input_len} + --output-len {spec.output_len} (range ratio {spec.range_ratio}) can reach "
            f"{longest} tokens; the model's context is {space.max_model_len} (lower them or raise --max-model-len)"
        )
    rng = np.random.default_rng(spec.seed)
    allowed = space.allowed_ids()
    input_lens = _lengths(rng, spec.input_len, spec.range_ratio, spec.num_prompts)
    output_lens = _lengths(rng, spec.output_len, spec.range_ratio, spec.num_prompts)
    return [BenchRequest(_token_ids(rng, allowed, int(i)), int(o)) for i, o in zip(input_lens, output_lens)]


def _lognormal(rng: np.random.Generator, mean: float, sigma: float, n: int) -> np.ndarray:
    # E[exp(N(mu, sigma^2))] = exp(mu + sigma^2 / 2) = mean
    return rng.lognormal(math.log(mean) - sigma * sigma / 2.0, sigma, size=n)


def sharegpt_like_requests(spec: DatasetSpec, space: TokenSpace) -> list[BenchRequest]:
    if space.max_model_len < 2 * SHAREGPT_MIN_INPUT:
        raise ValueError(f"the sharegpt-like dataset needs a context of >= {2 * SHAREGPT_MIN_INPUT} tokens")
    rng = np.random.default_rng(spec.seed)
    allowed = space.allowed_ids()
    max_input = min(SHAREGPT_MAX_INPUT, space.max_model_len // 2)
    inputs = np.clip(np.rint(_lognormal(rng, *SHAREGPT_INPUT, spec.num_prompts)), SHAREGPT_MIN_INPUT, max_input)
    outputs = np.rint(_lognormal(rng, *SHAREGPT_OUTPUT, spec.num_prompts))
    requests = []
    for i, o in zip(inputs.astype(int), outputs.astype(int)):
        o = int(min(max(o, 1), SHAREGPT_MAX_OUTPUT, space.max_model_len - i))
        requests.append(BenchRequest(_token_ids(rng, allowed, int(i)), o))
    return requests


def prefix_repetition_requests(spec: DatasetSpec, space: TokenSpace) -> list[BenchRequest]:
    total = spec.prefix_len + spec.suffix_len + spec.output_len
    if total > space.max_model_len:
        raise ValueError(
            f"--prefix-len {spec.prefix_len} + --suffix-len {spec.suffix_len} + --output-len {spec.output_len} = {total} "
            f"tokens exceeds the model's context of {space.max_model_len}"
        )
    if spec.prefix_len + spec.suffix_len < 1:
        raise ValueError("--prefix-len + --suffix-len must be >= 1")
    rng = np.random.default_rng(spec.seed)
    allowed = space.allowed_ids()
    prefixes = [_token_ids(rng, allowed, spec.prefix_len) for _ in range(spec.num_prefixes)]
    requests = [
        BenchRequest(prefixes[i % spec.num_prefixes] + _token_ids(rng, allowed, spec.suffix_len), spec.output_len)
        for i in range(spec.num_prompts)
    ]
    order = rng.permutation(len(requests))
    return [requests[i] for i in order]


def load_records(path: str | Path) -> list[dict]:
    """The records of a JSON list or a JSONL file."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"--dataset-path {str(path)!r} is not a file")
    text = path.read_text(encoding="utf-8")
    stripped = text.lstrip()
    if stripped.startswith("["):
        records = json.loads(text)
    else:
        records = [json.loads(line) for line in text.splitlines() if line.strip()]
    if not records or not all(isinstance(r, dict) for r in records):
        raise ValueError(f"{path}: expected a non-empty JSON list or JSONL of objects with a 'prompt' field")
    return records


def _record_request(record: dict, index: int, spec: DatasetSpec, space: TokenSpace) -> BenchRequest:
    prompt = record.get("prompt", record.get("prompt_token_ids"))
    output_len = int(record.get("output_len", record.get("max_tokens", spec.output_len)))
    if output_len < 1:
        raise ValueError(f"record {index}: output_len must be >= 1, got {output_len}")
    if isinstance(prompt, str):
        if space.tokenizer is None:
            raise ValueError(f"record {index} has a text prompt but the model has no tokenizer; give token ids")
        ids, text = tuple(space.tokenizer.encode(prompt)), prompt
    elif isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        ids, text = tuple(prompt), None
    else:
        raise ValueError(f"record {index}: 'prompt' must be a non-empty string or list of token ids, got {prompt!r:.80}")
    if not ids:
        raise ValueError(f"record {index}: the prompt tokenizes to nothing")
    if len(ids) + output_len > space.max_model_len:
        raise ValueError(
            f"record {index}: {len(ids)} prompt + {output_len} output tokens exceeds the context of {space.max_model_len}"
        )
    return BenchRequest(ids, output_len, text)


def file_requests(spec: DatasetSpec, space: TokenSpace) -> list[BenchRequest]:
    """The first ``num_prompts`` records of the file (all of them if it has fewer)."""
    records = load_records(spec.path)[: spec.num_prompts]
    return [_record_request(r, i, spec, space) for i, r in enumerate(records)]


def summarize(requests: list[BenchRequest]) -> dict[str, float]:
    inputs = [r.input_len for r in requests]
    outputs = [r.output_len for r in requests]
    return {
        "num_requests": len(requests),
        "total_input_tokens": int(sum(inputs)),
        "total_output_tokens": int(sum(outputs)),
        "mean_input_len": float(np.mean(inputs)) if inputs else 0.0,
        "mean_output_len": float(np.mean(outputs)) if outputs else 0.0,
        "max_input_len": int(max(inputs, default=0)),
        "max_output_len": int(max(outputs, default=0)),
    }
