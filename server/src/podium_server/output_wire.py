"""The engine's delta outputs as plain tuples for the engine process's report pipe (cheap to pickle).

The engine reports each request with ``output_kind="delta"``, so a report already holds only what
is new; this module only drops what the server has already (the prompt's token ids and text) and
flattens the dataclasses. No state on either side: each message decodes on its own.

    (request_id, finished, completions, prompt_logprobs | None, num_cached_tokens, metrics | None)
    completion: (index, new_text, new_token_ids, new_logprobs | None, cumulative_logprob,
                 finish_reason, stop_reason)

Metrics come with the final output only. A pooling model's output (``PoolingRequestOutput``, its
one report, finished) is a shorter tuple, its embedding a float32 numpy array (the server process
never imports torch; ``np.asarray`` reads either form):

    (request_id, embedding, metrics | None)
"""

from __future__ import annotations

from podium.outputs import CompletionOutput, PoolingOutput, PoolingRequestOutput, RequestOutput


def to_wire(delta: RequestOutput | PoolingRequestOutput) -> tuple:
    if isinstance(delta, PoolingRequestOutput):  # .numpy(): only the vector's own values are pickled
        return delta.request_id, delta.outputs.data.numpy(), delta.metrics
    completions = [(c.index, c.text, c.token_ids, c.logprobs, c.cumulative_logprob, c.finish_reason, c.stop_reason)
                   for c in delta.outputs]
    return (delta.request_id, delta.finished, completions, delta.prompt_logprobs, delta.num_cached_tokens,
            delta.metrics if delta.finished else None)


def from_wire(message: tuple) -> RequestOutput | PoolingRequestOutput:
    if len(message) == 3:
        request_id, embedding, metrics = message
        return PoolingRequestOutput(request_id, PoolingOutput(embedding), [], finished=True, metrics=metrics)
    request_id, finished, completions, prompt_logprobs, num_cached_tokens, metrics = message
    outputs = [CompletionOutput(index, text, token_ids, cumulative, logprobs, finish, stop)
               for index, text, token_ids, logprobs, cumulative, finish, stop in completions]
    return RequestOutput(request_id, None, [], outputs, finished, prompt_logprobs, metrics, num_cached_tokens)
