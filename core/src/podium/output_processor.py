"""After each step: append sampled tokens, detokenize, decide who stops, build RequestOutputs.

Stop rules, checked in this order after a token is appended (EOS and stop ids only once
``min_tokens`` outputs exist): EOS (unless ignore_eos) -> "stop"; a stop token id -> "stop" with
that id as stop_reason; a stop string completed by the new text -> "stop", text cut at it;
``max_tokens`` outputs -> "length"; the context full (``max_model_len``) -> "length".
While a sequence runs, its reported text holds back any tail that could still become a stop
string, so a stream never shows text that a stop string later cuts.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from .detokenizer import IncrementalDetokenizer, decode_token
from .outputs import CompletionOutput, RequestMetrics, RequestOutput
from .request import Sequence
from .stop import find_stop, safe_text_len


@dataclass
class SequenceState:
    """What the engine tracks per sequence besides its tokens."""

    seq: Sequence
    detokenizer: IncrementalDetokenizer | None
    text: str = ""
    cumulative_logprob: float | None = None
    logprobs: list | None = None


@dataclass
class RequestState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    sequences: list[SequenceState]
    metrics: RequestMetrics
    prompt_logprobs: list | None = None
    final_only: bool = False  # report the request once, when it finishes (offline generate)
    extra: dict = field(default_factory=dict)

    @property
    def finished(self) -> bool:
        return all(s.seq.is_finished for s in self.sequences)


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

    def append(self, state: SequenceState, token_id: int, logprobs) -> tuple[str, str | int | None] | None:
        """Append one sampled token; returns (finish_reason, stop_reason) if the sequence is done."""
        seq, p = state.seq, state.seq.params
        seq.append_token(token_id)
        if logprobs is not None and state.logprobs is not None:
            if self.tokenizer is not None:
                for tid, lp in logprobs.items():
                    lp.decoded_token = decode_token(self.tokenizer, tid)
            state.logprobs.append(logprobs)
            state.cumulative_logprob += logprobs[token_id].logprob
        new_len = 0
        if state.detokenizer is not None:
            delta = state.detokenizer.append([token_id])
            state.text += delta
            new_len = len(delta)
        can_stop = seq.num_output_tokens >= p.min_tokens
        if can_stop and not p.ignore_eos and token_id in self.eos_token_ids:
            return "stop", None
        if can_stop and token_id in p.stop_token_ids:
            return "stop", token_id
        if can_stop and p.stop and state.detokenizer is not None:
            stop_str, cut = find_stop(state.text, new_len, p.stop, p.include_stop_str_in_output)
            if stop_str is not None:
                state.text = state.text[:cut]
                return "stop", stop_str
        if p.max_tokens is not None and seq.num_output_tokens >= p.max_tokens:
            return "length", None
        if seq.num_tokens >= self.max_model_len:
            return "length", None
        return None

    @staticmethod
    def build_output(req: RequestState) -> RequestOutput:
        outputs = [
            CompletionOutput(
                index=s.seq.sample_index,
                text=s.text if s.seq.is_finished else s.text[: safe_text_len(s.text, s.seq.params.stop)],
                token_ids=s.seq.output_token_ids,
                cumulative_logprob=s.cumulative_logprob,
                logprobs=s.logprobs,
                finish_reason=s.seq.finish_reason,
                stop_reason=s.seq.stop_reason,
            )
            for s in req.sequences
        ]
        finished = req.finished
        if finished and req.metrics.finished_time is None:
            req.metrics.finished_time = time.time()
        return RequestOutput(
            request_id=req.request_id,
            prompt=req.prompt,
            prompt_token_ids=req.prompt_token_ids,
            outputs=outputs,
            finished=finished,
            prompt_logprobs=req.prompt_logprobs,
            metrics=req.metrics,
            num_cached_tokens=req.sequences[0].seq.num_cached_tokens,
        )
