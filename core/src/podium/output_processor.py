"""After each step: append sampled tokens, detokenize, decide who stops, build RequestOutputs.

Stop rules, checked in this order after a token is appended (EOS and stop ids only once
``min_tokens`` outputs exist): EOS (unless ignore_eos) -> "stop"; a stop token id -> "stop" with
that id as stop_reason; a stop string completed by the new text -> "stop", text cut at it;
``max_tokens`` outputs -> "length"; the context full (``max_model_len``) -> "length".
While a sequence runs, its reported text holds back any tail that could still become a stop
string, so a stream never shows text that a stop string later cuts.

What a request reports (``output_kind``, chosen per request, like vLLM's ``RequestOutputKind``):

- ``"cumulative"``: every step that changed it, the whole output so far (token ids, text, logprobs);
- ``"delta"``: every step that changed it, only what is new since its last report, and only the
  samples that changed (a streaming server's case: no per-step copy that grows with the output);
- ``"final"``: once, when every sample has finished, the whole output (offline ``generate``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Literal

from .detokenizer import IncrementalDetokenizer, decode_token
from .outputs import CompletionOutput, RequestMetrics, RequestOutput
from .request import Sequence, SequenceStatus
from .stop import find_stop, safe_text_len

OutputKind = Literal["cumulative", "delta", "final"]
OUTPUT_KINDS: tuple[str, ...] = ("cumulative", "delta", "final")
_FINISHED = SequenceStatus.FINISHED


@dataclass(slots=True)
class SequenceState:
    """What the engine tracks per sequence besides its tokens."""

    seq: Sequence
    detokenizer: IncrementalDetokenizer | None
    text: str = ""
    cumulative_logprob: float | None = None
    logprobs: list | None = None
    # "delta" reports: output tokens / characters / whether the finish already went out
    sent_tokens: int = 0
    sent_text: int = 0
    sent_finish: bool = False


@dataclass(slots=True)
class RequestState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    sequences: list[SequenceState]
    metrics: RequestMetrics
    prompt_logprobs: list | None = None
    output_kind: OutputKind = "cumulative"
    prompt_logprobs_sent: bool = False
    extra: dict = field(default_factory=dict)

    @property
    def finished(self) -> bool:
        for s in self.sequences:
            if s.seq.status is not _FINISHED:
                return False
        return True


class OutputProcessor:
    def __init__(self, tokenizer, eos_token_ids: list[int], max_model_len: int) -> None:
        self.tokenizer = tokenizer
        self.eos_token_ids = frozenset(eos_token_ids)
        self.max_model_len = max_model_len

    def new_state(self, seq: Sequence) -> SequenceState:
        p = seq.params
        detok = None
        if self.tokenizer is not None and p.detokenize:
            detok = IncrementalDetokenizer(self.tokenizer, seq.prompt_token_ids, p.skip_special_tokens,
                                           p.spaces_between_special_tokens)
        return SequenceState(seq, detok, cumulative_logprob=0.0 if p.logprobs is not None else None,
                             logprobs=[] if p.logprobs is not None else None)

    def append(self, state: SequenceState, token_id: int, logprobs,
               index: int | None = None) -> tuple[str, str | int | None] | None:
        """Append one sampled token; returns (finish_reason, stop_reason) if the sequence is done.

        ``index``: where the token goes in ``token_ids`` when it fills a placeholder (async
        scheduling); a finished sequence drops the placeholders after it.
        """
        seq = state.seq
        token_ids = seq.token_ids
        if index is None or index == len(token_ids):
            token_ids.append(token_id)
        else:
            token_ids[index] = token_id
            seq.num_pending_tokens -= 1
        finish = self._check(state, token_id, logprobs, len(token_ids) if index is None else index + 1)
        if finish is not None and seq.num_pending_tokens:
            del token_ids[len(token_ids) - seq.num_pending_tokens:]
            seq.num_pending_tokens = 0
        return finish

    def _check(self, state: SequenceState, token_id: int, logprobs, length: int) -> tuple[str, str | int | None] | None:
        """Book the token now at ``length - 1`` (logprobs, text) and apply the stop rules."""
        seq = state.seq
        p = seq.params
        if logprobs is not None and state.logprobs is not None:
            if self.tokenizer is not None:
                for tid, lp in logprobs.items():
                    lp.decoded_token = decode_token(self.tokenizer, tid)
            state.logprobs.append(logprobs)
            state.cumulative_logprob += logprobs[token_id].logprob
        new_len = 0
        if state.detokenizer is not None:
            delta = state.detokenizer.append_token(token_id)
            if delta:
                state.text += delta
                new_len = len(delta)
        num_output = length - len(seq.prompt_token_ids)
        if num_output >= p.min_tokens:
            if token_id in self.eos_token_ids and not p.ignore_eos:
                return "stop", None
            if p.stop_token_ids and token_id in p.stop_token_ids:
                return "stop", token_id
            if p.stop and state.detokenizer is not None:
                stop_str, cut = find_stop(state.text, new_len, p.stop, p.include_stop_str_in_output)
                if stop_str is not None:
                    state.text = state.text[:cut]
                    return "stop", stop_str
        if p.max_tokens is not None and num_output >= p.max_tokens:
            return "length", None
        if length >= self.max_model_len:
            return "length", None
        return None

    @staticmethod
    def build_output(req: RequestState) -> RequestOutput:
        """The request's report for this step, in its ``output_kind``."""
        sequences = req.sequences
        if len(sequences) == 1:
            finished = sequences[0].seq.status is _FINISHED
        else:
            finished = req.finished
        if req.output_kind == "delta":
            if len(sequences) == 1:
                output = _delta_output(sequences[0])
                outputs = [output] if output is not None else []
            else:
                outputs = [o for o in map(_delta_output, sequences) if o is not None]
            prompt_logprobs = None
            if not req.prompt_logprobs_sent and req.prompt_logprobs is not None:
                prompt_logprobs, req.prompt_logprobs_sent = req.prompt_logprobs, True
        else:
            outputs = list(map(_cumulative_output, req.sequences))
            prompt_logprobs = req.prompt_logprobs
        metrics = req.metrics
        if finished and metrics.finished_time is None:
            metrics.finished_time = time.time()
        return RequestOutput(req.request_id, req.prompt, req.prompt_token_ids, outputs, finished, prompt_logprobs,
                             metrics, req.sequences[0].seq.num_cached_tokens)


def _visible_text(s: SequenceState, finished: bool) -> int:
    """How much of the text may be reported: all once finished, else short of a possible stop string."""
    stop = s.seq.params.stop
    return len(s.text) if finished or not stop else safe_text_len(s.text, stop)


def _cumulative_output(s: SequenceState) -> CompletionOutput:
    seq = s.seq
    finished = seq.status is _FINISHED
    text = s.text if finished or not seq.params.stop else s.text[: _visible_text(s, False)]
    logprobs = list(s.logprobs) if s.logprobs is not None else None  # a snapshot: later steps append
    return CompletionOutput(seq.sample_index, text, seq.output_token_ids, s.cumulative_logprob,
                            logprobs, seq.finish_reason, seq.stop_reason)


def _delta_output(s: SequenceState) -> CompletionOutput | None:
    """What is new since this sequence's last report; None when nothing is."""
    seq = s.seq
    token_ids = seq.token_ids
    start = len(seq.prompt_token_ids) + s.sent_tokens  # the first token not yet reported
    end = len(token_ids) - seq.num_pending_tokens  # placeholders are not reported
    finished = seq.status is _FINISHED
    if start == end and (s.sent_finish or not finished):
        return None
    text, sent_text, stop = s.text, s.sent_text, seq.params.stop
    visible = len(text) if finished or not stop else safe_text_len(text, stop)
    delta = text[sent_text:visible] if visible > sent_text else ""
    logprobs = s.logprobs[s.sent_tokens:] if s.logprobs is not None else None
    s.sent_tokens = end - len(seq.prompt_token_ids)
    s.sent_text = visible if visible > sent_text else sent_text
    s.sent_finish = finished
    return CompletionOutput(seq.sample_index, delta, token_ids[start:end], s.cumulative_logprob, logprobs,
                            seq.finish_reason, seq.stop_reason)
