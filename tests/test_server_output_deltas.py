"""Outputs over the engine process's pipe: what the server rebuilds equals what the engine gave.

The property a bug would break: after every step, the decoded output equals the engine's
cumulative output field for field, while each message carries only what is new.
"""

from __future__ import annotations

import pickle

from podium.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from podium_server.output_deltas import DeltaDecoder, DeltaEncoder

PROMPT = [5, 6, 7]


def output(texts: list[str], tokens: list[list[int]], logprobs: list | None = None, finished: bool = False,
           prompt_logprobs: list | None = None) -> RequestOutput:
    completions = [CompletionOutput(i, text, ids, -1.0 * len(ids), logprobs[i] if logprobs else None,
                                    "length" if finished else None) for i, (text, ids) in enumerate(zip(texts, tokens))]
    return RequestOutput("r", None, PROMPT, completions, finished, prompt_logprobs,
                         RequestMetrics(arrival_time=1.0) if finished else None, num_cached_tokens=2)


def over_the_pipe(encoder: DeltaEncoder, decoder: DeltaDecoder, out: RequestOutput) -> RequestOutput | None:
    return decoder.decode(pickle.loads(pickle.dumps(encoder.encode(out))))


def test_decoded_outputs_equal_the_engines_at_every_step():
    encoder, decoder = DeltaEncoder(), DeltaDecoder()
    decoder.open("r", PROMPT)
    lp = [[], []]
    steps = []
    for k in range(1, 6):
        for i in range(2):
            lp[i].append({k + i: Logprob(-0.1 * k, 1, str(k + i))})
        texts = [" ".join(str(t) for t in range(1, k + 1)), "x" * k]
        steps.append(output(texts, [list(range(1, k + 1)), [9] * k], [list(lp[0]), list(lp[1])], finished=k == 5,
                            prompt_logprobs=[None, {6: Logprob(-1.0)}][: min(k, 2)]))
    steps.insert(3, output(["1 2 3 CUT", "xxx"], [[1, 2, 3, 4], [9] * 4], [lp[0][:4], lp[1][:4]],
                           prompt_logprobs=steps[2].prompt_logprobs))  # the text changed other than by growing
    for out in steps:
        assert over_the_pipe(encoder, decoder, out) == out
    assert not encoder._sent and not decoder._requests  # both forget a finished request


def test_a_delta_carries_only_what_is_new():
    encoder = DeltaEncoder()
    encoder.encode(output(["hello"], [[1, 2]]))
    _, _, (completion,), _, _, metrics = encoder.encode(output(["hello world"], [[1, 2, 3]]))
    assert completion[1:5] == (5, " world", 2, [3]) and metrics is None


def test_released_and_rejected_requests_are_forgotten():
    encoder, decoder = DeltaEncoder(), DeltaDecoder()
    decoder.open("r", PROMPT)
    over_the_pipe(encoder, decoder, output(["a"], [[1]]))
    decoder.close("r")  # the reader went away: late outputs are dropped
    assert over_the_pipe(encoder, decoder, output(["ab"], [[1, 2]])) is None
    encoder.forget(["r"])  # the engine aborted it
    assert not encoder._sent
