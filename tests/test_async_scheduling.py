"""Async scheduling gives exactly the synchronous engine's outputs, and leaks nothing.

On the CPU a "launched" step has already run, but every part of the async path runs: placeholders,
the next step taking them from the previous step's token tensor, stop rules applied one step
late, the extra token of a sequence that stopped dropped, length-ended sequences getting no
placeholder, steps that need host tokens (penalties, logprobs) falling back to synchronous.
"""

from __future__ import annotations

import random

import pytest
from engine_fixtures import GOLDEN_PROMPTS, smollm2_gguf

from podium import SamplingParams
from podium.engine import LLMEngine


def workload() -> list[tuple[str, str, SamplingParams]]:
    rng = random.Random(1)
    requests = []
    for i, prompt in enumerate(GOLDEN_PROMPTS * 2):
        kind = i % 6
        if kind == 0:
            params = SamplingParams(temperature=0, max_tokens=rng.randint(1, 30), ignore_eos=True)
        elif kind == 1:
            params = SamplingParams(temperature=0.8, top_p=0.9, seed=i, max_tokens=rng.randint(5, 30))
        elif kind == 2:
            params = SamplingParams(temperature=0, max_tokens=40, stop=[".", "\n"])
        elif kind == 3:
            params = SamplingParams(temperature=0.7, seed=i, n=2, max_tokens=12, min_tokens=3)
        elif kind == 4:
            params = SamplingParams(temperature=0, max_tokens=20)  # may end on EOS
        else:
            params = SamplingParams(temperature=0, max_tokens=10, stop_token_ids=[13, 28], ignore_eos=True)
        requests.append((f"r{i}", prompt, params))
    return requests


def run(engine: LLMEngine, requests, abort_at: dict[int, str] | None = None) -> dict:
    texts, finals = {}, {}
    for rid, prompt, params in requests:
        engine.add_request(rid, prompt, params, output_kind="delta")
    step = 0
    while engine.has_unfinished_requests():
        if abort_at and step in abort_at:
            engine.abort_request(abort_at[step])
        for out in engine.step():
            for sample in out.outputs:
                key = (out.request_id, sample.index)
                text, ids = texts.get(key, ("", []))
                texts[key] = (text + sample.text, ids + sample.token_ids)
                assert -1 not in sample.token_ids, "a placeholder was reported"
                if sample.finish_reason is not None:
                    assert key not in finals, "reported finished twice"
                    finals[key] = (sample.finish_reason, sample.stop_reason)
        step += 1
    stats = engine.stats()
    assert stats.num_free_blocks == stats.num_total_blocks and stats.num_running == stats.num_waiting == 0
    assert engine._in_flight is None or all(s.is_finished for s in engine._in_flight.seqs)
    return {key: (*texts.get(key, ("", [])), finals.get(key)) for key in set(texts) | set(finals)}


def make_engine(async_scheduling: bool, **kwargs) -> LLMEngine:
    smollm2_gguf()
    return LLMEngine(model="smollm2-135m-instruct", dtype="float32", device="cpu", max_model_len=256,
                     async_scheduling=async_scheduling, **kwargs)


@pytest.fixture(scope="module")
def sync_outputs():
    engine = make_engine(False)
    assert not engine.async_scheduling
    return run(engine, workload())


@pytest.mark.parametrize("options", [{}, {"max_num_batched_tokens": 24}, {"num_kv_blocks": 16}],
                         ids=["plain", "chunked-prefill", "preemption"])
def test_async_outputs_equal_sync_outputs(sync_outputs, options):
    engine = make_engine(True, **options)
    assert engine.async_scheduling
    got = run(engine, workload())
    assert got == sync_outputs
    if "num_kv_blocks" in options:
        assert engine.stats().num_preemptions > 0


def test_some_steps_really_were_deferred():
    engine = make_engine(True)
    deferred = 0
    for rid, prompt, params in workload()[:4]:
        engine.add_request(rid, prompt, params)
    while engine.has_unfinished_requests():
        engine.step()
        deferred += engine._in_flight is not None
    assert deferred > 10


def test_penalties_and_logprobs_run_synchronously_and_match(sync_outputs):
    extra = [("pen", "The quick brown fox", SamplingParams(temperature=0, max_tokens=15, repetition_penalty=1.3,
                                                            frequency_penalty=0.5, ignore_eos=True)),
             ("lp", "Water boils at", SamplingParams(temperature=0, max_tokens=8, logprobs=3, ignore_eos=True))]
    want = run(make_engine(False), extra)
    assert run(make_engine(True), extra) == want


def test_abort_while_a_step_is_in_flight_frees_everything():
    engine = make_engine(True)
    requests = workload()[:6]
    run(engine, requests, abort_at={3: "r0", 5: "r2", 6: "r4"})  # run() checks every block is free
