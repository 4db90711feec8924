"""What ``step()`` reports per ``output_kind``: delta reports add up to the cumulative ones, exactly.

The same requests (n = 1 and n = 3, logprobs, a stop string that cuts the text, a sampled request
with a seed) run twice on the real SmolLM2 engine, once with ``"cumulative"`` and once with
``"delta"`` outputs; concatenating the deltas (``RequestOutput.add``, what a streaming server
does) must give each step's cumulative output, and a ``"final"`` request reports exactly once.
What the engine refuses at ``add_request`` comes as a typed error (``podium.errors``) that keeps
its fields through pickling (the server's engine process sends it over a pipe).
"""

from __future__ import annotations

import pickle

import pytest
from engine_fixtures import smollm2_gguf

from podium import SamplingParams
from podium.chat_template import ChatPrompt
from podium.engine import LLMEngine
from podium.errors import ChatTemplateError, InvalidParameter, PromptTooLong

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


def test_deltas_add_up_to_the_cumulative_outputs(engine):
    cumulative, delta = run(engine, "cumulative"), run(engine, "delta")
    assert len(cumulative) == len(delta)  # same engine, same schedule
    whole = {}  # request id -> its deltas so far, added up
    for step_c, step_d in zip(cumulative, delta):
        by_id = {o.request_id: o for o in step_c}
        assert {o.request_id for o in step_d} == set(by_id)
        for out in step_d:
            for sample in out.outputs:
                assert sample.token_ids or sample.finish_reason is not None, "an empty delta was reported"
            if out.request_id in whole:
                whole[out.request_id].add(out)
            else:
                whole[out.request_id] = out
            got = {c.index: c for c in whole[out.request_id].outputs}
            for want in by_id[out.request_id].outputs:  # each step: deltas so far == the cumulative view
                have = got[want.index]
                assert have.token_ids == want.token_ids
                assert have.text == want.text
                assert have.finish_reason == want.finish_reason
                assert have.cumulative_logprob == want.cumulative_logprob
                if want.logprobs is not None:
                    assert have.logprobs == want.logprobs
            assert whole[out.request_id].finished == out.finished == by_id[out.request_id].finished
    samples = {(rid, c.index): c for rid, out in whole.items() for c in out.outputs}
    assert len(samples) == sum(p.n for _, p in REQUESTS.values())
    assert all(c.finish_reason is not None for c in samples.values())
    stop = samples["stop", 0]
    assert stop.finish_reason == "stop" and not stop.text.endswith((" and", "."))  # the cut held
    assert len(samples["logprobs", 0].logprobs) == 12
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


def test_a_chat_prompt_is_rendered_by_the_engine(engine):
    messages = [{"role": "user", "content": "Name a planet."}]
    assert engine.add_request("chat", ChatPrompt(messages), SamplingParams(max_tokens=2)) == \
        len(engine.apply_chat_template(messages))
    engine.abort_request("chat")
    with pytest.raises(ChatTemplateError, match="cannot apply the chat template.*nope") as failed:
        engine.add_request("bad", ChatPrompt(messages, chat_template="{{ raise_exception('nope') }}"))
    assert failed.value.param == "messages" and not engine.has_unfinished_requests()


@pytest.mark.parametrize(("prompt", "params", "error", "param", "text"), [
    ([1] * 250, SamplingParams(max_tokens=10), PromptTooLong, "prompt", "(250 in the prompt, 10 for the completion)"),
    ([1] * 256, SamplingParams(), PromptTooLong, "prompt", "which leaves none for the completion"),
    ([10**9], SamplingParams(), InvalidParameter, "prompt", "prompt token ids must be in"),
    ([1], SamplingParams(), None, None, None),
])
def test_refusals_are_typed_and_survive_pickling(engine, prompt, params, error, param, text):
    if error is None:  # the control: the same path accepts a good request
        assert engine.add_request("ok", prompt, params) == 1
        engine.abort_request("ok")
        return
    with pytest.raises(error) as refused:
        engine.add_request("refused", prompt, params)
    again = pickle.loads(pickle.dumps(refused.value))
    assert type(again) is error and again.param == param and text in str(again) and str(again) == str(refused.value)
    if error is PromptTooLong:
        assert (again.prompt_len, again.max_model_len) == (len(prompt), 256)
    assert not engine.has_unfinished_requests()
