"""What ``step()`` reports per ``output_kind``: delta reports add up to the cumulative ones, exactly.

The same requests (n = 1 and n = 3, logprobs, a stop string that cuts the text, a sampled request
with a seed) run twice on the real SmolLM2 engine, once with ``"cumulative"`` and once with
``"delta"`` outputs; concatenating the deltas must give each step's cumulative output, and a
``"final"`` request reports exactly once.
"""

from __future__ import annotations

import pytest
from engine_fixtures import smollm2_gguf

from podium import SamplingParams
from podium.engine import LLMEngine

REQUESTS = {
    "plain": ("The capital of France is", SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)),
    "logprobs": ("Water boils at", SamplingParams(temperature=0, max_tokens=12, logprobs=2, ignore_eos=True)),
    "samples": ("Once upon a time,", SamplingParams(temperature=0.9, seed=7, n=3, max_tokens=15, ignore_eos=True)),
    "stop": ("The three primary colors are", SamplingParams(temperature=0, max_tokens=40, stop=[" and", "."])),
}


@pytest.fixture(scope="module")
def engine() -> LLMEngine:
    smollm2_gguf()
    return LLMEngine(model="smollm2-135m-instruct", dtype="float32", device="cpu", max_model_len=256)


def run(engine: LLMEngine, kind: str) -> list[list]:
    for rid, (prompt, params) in REQUESTS.items():
        engine.add_request(rid, prompt, params, output_kind=kind)
    steps = []
    while engine.has_unfinished_requests():
        steps.append(engine.step())
    return steps


class Accumulated:
    """Concatenated delta reports of one sample."""

    def __init__(self) -> None:
        self.text, self.token_ids, self.logprobs = "", [], []
        self.finish_reason = None

    def add(self, out) -> None:
        assert self.finish_reason is None, "a sample reported again after it finished"
        self.text += out.text
        self.token_ids += out.token_ids
        if out.logprobs is not None:
            self.logprobs += out.logprobs
        self.finish_reason = out.finish_reason


def test_deltas_add_up_to_the_cumulative_outputs(engine):
    cumulative, delta = run(engine, "cumulative"), run(engine, "delta")
    assert len(cumulative) == len(delta)  # same engine, same schedule
    acc = {(rid, i): Accumulated() for rid, (_, p) in REQUESTS.items() for i in range(p.n)}
    for step_c, step_d in zip(cumulative, delta):
        by_id = {o.request_id: o for o in step_c}
        assert {o.request_id for o in step_d} == set(by_id)
        for out in step_d:
            for sample in out.outputs:
                assert sample.token_ids or sample.finish_reason is not None, "an empty delta was reported"
                acc[out.request_id, sample.index].add(sample)
            for want in by_id[out.request_id].outputs:  # each step: deltas so far == the cumulative view
                got = acc[out.request_id, want.index]
                assert got.token_ids == want.token_ids
                assert got.text == want.text
                assert got.finish_reason == want.finish_reason
                if want.logprobs is not None:
                    assert got.logprobs == want.logprobs
            assert out.finished == by_id[out.request_id].finished
    assert all(a.finish_reason is not None for a in acc.values())
    stop = acc["stop", 0]
    assert stop.finish_reason == "stop" and not stop.text.endswith((" and", "."))  # the cut held
    assert len(acc["logprobs", 0].logprobs) == 12
    assert engine.stats().num_free_blocks == engine.stats().num_total_blocks


def test_deltas_only_carry_the_samples_that_changed(engine):
    seen_finished = set()
    for step in run(engine, "delta"):
        for out in step:
            for sample in out.outputs:
                key = (out.request_id, sample.index)
                assert key not in seen_finished
                if sample.finish_reason is not None:
                    seen_finished.add(key)
    assert len(seen_finished) == sum(p.n for _, p in REQUESTS.values())


def test_final_reports_once_with_the_whole_output(engine):
    cumulative = run(engine, "cumulative")
    last = {o.request_id: o for step in cumulative for o in step if o.finished}
    reports = [o for step in run(engine, "final") for o in step]
    assert sorted(o.request_id for o in reports) == sorted(REQUESTS)
    for out in reports:
        assert out.finished
        assert [(s.token_ids, s.text) for s in out.outputs] == \
            [(s.token_ids, s.text) for s in last[out.request_id].outputs]


def test_unknown_output_kind_is_an_error(engine):
    with pytest.raises(ValueError, match="output_kind"):
        engine.add_request("x", "Hi", SamplingParams(max_tokens=2), output_kind="streaming")
