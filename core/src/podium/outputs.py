"""What the engine returns; shaped like vLLM's ``RequestOutput`` / ``CompletionOutput``."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class Logprob:
    logprob: float
    rank: int | None = None  # 1 = the most likely token
    decoded_token: str | None = None


# one entry per position: token id -> its Logprob (the chosen token plus the top-N)
PositionLogprobs = dict[int, Logprob]


@dataclass(slots=True)
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: list[PositionLogprobs] | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort" | None while running
    stop_reason: str | int | None = None  # the stop string or stop token id that ended it

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    num_cached_prompt_tokens: int = 0


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    metrics: RequestMetrics | None = None
    num_cached_tokens: int = 0
    extra: dict = field(default_factory=dict)
    # set when the engine failed this request (a fault in a step it was part of); ``finished`` is
    # then True and the unfinished samples' finish_reason is "error"
    error: str | None = None

    def add(self, delta: RequestOutput) -> None:
        """Append a later ``output_kind="delta"`` report of the same request to this one (itself a delta
        or the sum of earlier ones), as vLLM's ``RequestOutput.add``: texts, token ids and logprobs
        grow, the rest is the newer report's. The sum of every delta is the cumulative output."""
        mine = {c.index: c for c in self.outputs}
        for c in delta.outputs:
            have = mine.get(c.index)
            if have is None:
                mine[c.index] = c
                self.outputs.append(c)
                continue
            have.text += c.text
            have.token_ids.extend(c.token_ids)
            if c.logprobs is not None:
                if have.logprobs is None:
                    have.logprobs = []
                have.logprobs.extend(c.logprobs)
            have.cumulative_logprob, have.finish_reason, have.stop_reason = \
                c.cumulative_logprob, c.finish_reason, c.stop_reason
        if delta.prompt_logprobs is not None and self.prompt_logprobs is None:
            self.prompt_logprobs = delta.prompt_logprobs
        self.finished = delta.finished
        self.metrics = delta.metrics or self.metrics
        self.num_cached_tokens = delta.num_cached_tokens
        self.error = delta.error or self.error


@dataclass(slots=True)
class PoolingOutput:
    """A pooling model's output for one input: ``data`` [dimensions] float32 on the host (None when
    the request failed)."""

    data: object  # torch.Tensor (not imported here: outputs stay importable without torch)


@dataclass(slots=True)
class PoolingRequestOutput:
    """What a pooling request finishes with (vLLM's shape); reported once, finished. ``error``: why
    the engine failed it (a fault in its step), as ``RequestOutput.error``; then no data."""

    request_id: str
    outputs: PoolingOutput
    prompt_token_ids: list[int]
    finished: bool = True
    prompt: str | None = None
    metrics: RequestMetrics | None = None
    error: str | None = None


@dataclass(slots=True)
class EmbeddingOutput:
    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass(slots=True)
class EmbeddingRequestOutput:
    """``LLM.embed``'s result per input: ``outputs.embedding`` is a list of floats (vLLM's shape)."""

    request_id: str
    outputs: EmbeddingOutput
    prompt_token_ids: list[int]
    finished: bool = True
    error: str | None = None  # the pooling output's (then the embedding is empty)

    @classmethod
    def from_base(cls, output: PoolingRequestOutput) -> EmbeddingRequestOutput:
        data = output.outputs.data
        return cls(output.request_id, EmbeddingOutput([] if data is None else data.tolist()), output.prompt_token_ids,
                   output.finished, output.error)
