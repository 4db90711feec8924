"""A pooling model in the engine: choosing it, its requests, and its one kind of step.

A pooling request is one sequence that computes its whole input in one step (the scheduler does
not chunk it: ``Scheduler(chunked_prefill=False)`` and a token budget of at least ``max_model_len``)
and then finishes: its embedding is pooled from that step's hidden states and its blocks are freed
at once. An encoder (``uses_kv_cache = False``: BERT) writes no KV cache at all; its blocks are
bookkeeping for the scheduler's admission. A decoder run as a pooling model (Qwen3-Embedding's
shape) writes its K/V into blocks it holds for that one step. Nothing decodes, nothing is sampled,
nothing is cached for a later prefix.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

from .outputs import PoolingOutput, PoolingRequestOutput, RequestMetrics
from .pooling import Pooler, read_folder_pooling
from .pooling_config import PoolerConfig
from .pooling_params import PoolingParams
from .runner import plan_step
from .scheduler import Scheduler, SchedulerOutput

logger = logging.getLogger(__name__)


@dataclass
class PoolingRequest:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: PoolingParams
    metrics: RequestMetrics


def select_pooler(runner: str, model_cls: type, source, overrides: PoolerConfig | None,
                  model_name: str) -> tuple[Pooler | None, int | None]:
    """(the pooler, the folder's input-length cap or None) when the engine pools; (None, None) when
    it generates. ValueError when ``runner`` asks an encoder to generate."""
    pooling_only = bool(getattr(model_cls, "pooling_only", False))
    if runner == "generate" and pooling_only:
        raise ValueError(f"model {model_name!r} ({model_cls.__name__}) is an encoder: it computes embeddings, not "
                         "text; run it with runner='pooling' (or leave runner='auto')")
    if runner == "generate" or (runner == "auto" and not pooling_only):
        if overrides is not None:
            logger.warning("pooler_config is ignored: model %r generates text (runner='pooling' makes it pool)",
                           model_name)
        return None, None
    folder = read_folder_pooling(source.path)
    encoder = not getattr(model_cls, "uses_kv_cache", True)
    pooler = Pooler.for_model(source.hf_config, folder, overrides, encoder)
    logger.info("pooling model %r: %s", model_name, pooler.describe())
    return pooler, folder.max_seq_length


def pooling_step(plan: SchedulerOutput, runner, pooler: Pooler, requests: dict, scheduler: Scheduler,
                 grad_off: Callable) -> list[PoolingRequestOutput]:
    """Run ``plan`` (whole inputs), pool each sequence and finish it; returns the outputs in plan order."""
    step = plan_step(plan)
    with grad_off():
        hidden = runner.hidden_states(step)  # [T, hidden]
        pooled = pooler.pool(hidden, step.query_lens)  # [S, hidden], host
    # every embedding first: a fault raised here leaves each request of the step unfinished, for the
    # engine's recovery to fail or retry; none is finished without its report
    outputs = [PoolingRequestOutput(req.request_id, PoolingOutput(pooler.finish(vector, req.params)),
                                    req.prompt_token_ids, finished=True, prompt=req.prompt, metrics=req.metrics)
               for req, vector in zip((requests.get(item.seq.request_id) for item in plan.scheduled), pooled)
               if req is not None]  # None: aborted while the step ran
    for item in plan.scheduled:
        scheduler.finish(item.seq, "stop")
        requests.pop(item.seq.request_id, None)
    return outputs


def failed_output(req: PoolingRequest, message: str) -> PoolingRequestOutput:
    """The report of a pooling request the engine failed (a fault in its step): no data, the error."""
    return PoolingRequestOutput(req.request_id, PoolingOutput(None), req.prompt_token_ids, finished=True,
                                prompt=req.prompt, metrics=req.metrics, error=message)
