"""Outputs over a pipe as deltas: the engine's cumulative ``RequestOutput`` rebuilt on the other side.

The engine reports every request's whole text, token ids and logprobs so far at every step;
pickling that would cost O(length) per token, O(length²) per request. The engine process sends
only what is new since the last output of the same request; the server process appends it to
what it has and hands the handlers the same cumulative ``RequestOutput`` the thread mode gives.

One delta, a plain tuple (cheap to pickle):

    (request_id, finished, completions, new_prompt_logprobs | None, num_cached_tokens, metrics | None)
    completion: (index, keep_chars, new_text, keep_tokens, new_token_ids, new_logprobs | None,
                 cumulative_logprob, finish_reason, stop_reason)

``keep_chars`` / ``keep_tokens`` say how much of what was sent before still stands (all of it,
unless the text changed other than by growing); the new part follows. Metrics come with the
final output only.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from podium.outputs import CompletionOutput, RequestOutput


@dataclass
class _Sent:
    """What the encoder sent so far for one request: per completion (text, tokens, logprob entries)."""

    completions: dict[int, tuple[str, int, int]] = field(default_factory=dict)
    prompt_logprobs: int = 0


class DeltaEncoder:
    """The engine process's side."""

    def __init__(self) -> None:
        self._sent: dict[str, _Sent] = {}

    def encode(self, output: RequestOutput) -> tuple:
        sent = self._sent.get(output.request_id)
        if sent is None:
            sent = self._sent[output.request_id] = _Sent()
        completions = []
        for c in output.outputs:
            text, num_tokens, num_logprobs = sent.completions.get(c.index, ("", 0, 0))
            keep_chars = len(text) if c.text.startswith(text) else 0
            keep_tokens = min(num_tokens, len(c.token_ids))
            new_logprobs = None
            if c.logprobs is not None:  # the engine only ever appends to it
                new_logprobs = c.logprobs[num_logprobs:]
            completions.append((c.index, keep_chars, c.text[keep_chars:], keep_tokens, c.token_ids[keep_tokens:],
                                new_logprobs, c.cumulative_logprob, c.finish_reason, c.stop_reason))
            sent.completions[c.index] = (c.text, len(c.token_ids), len(c.logprobs or ()))
        new_prompt_logprobs = None
        if output.prompt_logprobs is not None:
            new_prompt_logprobs = output.prompt_logprobs[sent.prompt_logprobs:]
            sent.prompt_logprobs = len(output.prompt_logprobs)
        if output.finished:
            del self._sent[output.request_id]
        return (output.request_id, output.finished, completions, new_prompt_logprobs, output.num_cached_tokens,
                output.metrics if output.finished else None)

    def forget(self, request_ids: list[str]) -> None:
        """Drop the state of aborted requests."""
        for request_id in request_ids:
            self._sent.pop(request_id, None)


@dataclass
class _Assembled:
    prompt_token_ids: list[int]
    texts: dict[int, str] = field(default_factory=dict)
    token_ids: dict[int, list[int]] = field(default_factory=dict)
    logprobs: dict[int, list] = field(default_factory=dict)  # only for completions that have logprobs
    prompt_logprobs: list | None = None


class DeltaDecoder:
    """The server process's side: ``open`` a request when sending it, ``decode`` its deltas."""

    def __init__(self) -> None:
        self._requests: dict[str, _Assembled] = {}

    def open(self, request_id: str, prompt_token_ids: list[int]) -> None:
        self._requests[request_id] = _Assembled(prompt_token_ids)

    def close(self, request_id: str) -> None:
        self._requests.pop(request_id, None)

    def decode(self, delta: tuple) -> RequestOutput | None:
        """The cumulative output, or None for a request closed meanwhile (released by its reader)."""
        request_id, finished, completions, new_prompt_logprobs, num_cached_tokens, metrics = delta
        req = self._requests.get(request_id)
        if req is None:
            return None
        outputs = []
        for index, keep_chars, new_text, keep_tokens, new_ids, new_logprobs, cumulative, finish, stop in completions:
            text = req.texts.get(index, "")
            text = req.texts[index] = (text if keep_chars == len(text) else text[:keep_chars]) + new_text
            ids = req.token_ids.setdefault(index, [])
            del ids[keep_tokens:]
            ids.extend(new_ids)
            logprobs = None
            if new_logprobs is not None:
                logprobs = req.logprobs.setdefault(index, [])
                logprobs.extend(new_logprobs)
            outputs.append(CompletionOutput(index, text, list(ids), cumulative, logprobs, finish, stop))
        if new_prompt_logprobs is not None:
            req.prompt_logprobs = (req.prompt_logprobs or []) + new_prompt_logprobs
        if finished:
            del self._requests[request_id]
        return RequestOutput(request_id, None, req.prompt_token_ids, outputs, finished, req.prompt_logprobs,
                             metrics, num_cached_tokens)
