"""vLLM's ways in: prompt shapes (``podium.inputs``), ``LLM.chat``'s template arguments,
``generation_config.json`` defaults and priority scheduling, on tiny models and the embedded SmolLM2."""

from __future__ import annotations

import json

import pytest

from podium import LLM, SamplingParams
from podium.explicit_fields import explicit_fields
from podium.inputs import TextPrompt, TokensPrompt, parse_prompt, parse_prompts

GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)


def test_prompt_shapes():
    assert parse_prompts("hi") == ["hi"]
    assert parse_prompts(TokensPrompt(prompt_token_ids=[5, 6])) == [[5, 6]]
    assert parse_prompts([TextPrompt(prompt="a"), {"prompt_token_ids": (1, 2)}, "b"]) == ["a", [1, 2], "b"]
    assert parse_prompts([]) == []
    for bad, message in [
        ([1, 2, 3], "TokensPrompt"),
        ({"prompt": "a", "prompt_token_ids": [1]}, "not both"),
        ({"prompt_token_ids": [1], "multi_modal_data": {}}, "multi_modal_data: Podium serves text models only"),
        ({"promt": "typo"}, r"unknown key\(s\) \['promt'\]"),
        ({"prompt_token_ids": "abc"}, "list of integers"),
        ({"prompt": [1, 2]}, "'prompt' must be text"),
        ({}, "needs 'prompt'"),
        (3.5, "must be a prompt or a list"),
    ]:
        with pytest.raises(ValueError, match=message):
            parse_prompts(bad)
    with pytest.raises(ValueError, match="got int"):
        parse_prompt(7)


@pytest.fixture(scope="module")
def smollm2():
    return LLM("smollm2-135m-instruct", device="cpu", max_model_len=256, max_num_seqs=8, enforce_eager=True)


def test_every_prompt_shape_gives_the_same_greedy_tokens(smollm2):
    text = "The capital of France is"
    ids = smollm2.get_tokenizer().encode(text)
    outs = smollm2.generate([text, TextPrompt(prompt=text), TokensPrompt(prompt_token_ids=ids),
                             {"prompt_token_ids": ids}], GREEDY, use_tqdm=False)
    assert len({tuple(o.outputs[0].token_ids) for o in outs}) == 1
    assert [o.prompt_token_ids for o in outs] == [ids] * 4
    with pytest.raises(ValueError, match="lora_request must be a LoRARequest"):
        smollm2.generate(text, GREEDY, lora_request=object())


TEMPLATE = ("{% if tools %}TOOLS:{% for t in tools %}{{ t.function.name }};{% endfor %}|{% endif %}"
            "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% if greeting %} {{ greeting }}{% endif %}|"
            "{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}")
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}},
         {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}]


def test_chat_template_tools_and_kwargs_reach_the_template(smollm2, tmp_path):
    """What the template renders, decoded back: the tools, the extra variable, the generation prompt."""
    engine = smollm2.engine
    messages = [{"role": "user", "content": "Hi"}]
    decode = smollm2.get_tokenizer().decode
    text = decode(engine.apply_chat_template(messages, chat_template=TEMPLATE, tools=TOOLS, greeting="there"))
    assert text == "TOOLS:get_weather;get_time;|<user>Hi there|<assistant>"
    file = tmp_path / "template.jinja"
    file.write_text(TEMPLATE)
    assert decode(engine.apply_chat_template(messages, False, chat_template=str(file))) == "<user>Hi|"
    own = decode(engine.apply_chat_template(messages))  # the model's own template: ChatML
    assert "<|im_start|>user\nHi<|im_end|>" in own and own.endswith("<|im_start|>assistant\n")
    with pytest.raises(ValueError, match="neither a Jinja template nor a readable file"):
        engine.apply_chat_template(messages, chat_template="no-such-template.jinja")
    with pytest.raises(ValueError, match="add_generation_prompt=False"):
        engine.apply_chat_template(messages, continue_final_message=True)
    partial = [*messages, {"role": "assistant", "content": "Hel"}]
    continued = decode(engine.apply_chat_template(partial, False, continue_final_message=True))
    assert continued.endswith("<|im_start|>assistant\nHel")


def test_llm_chat_with_a_template_generates_from_what_it_renders(smollm2):
    messages = [{"role": "user", "content": "Hi"}]
    chat = smollm2.chat(messages, GREEDY, use_tqdm=False, chat_template=TEMPLATE, tools=TOOLS,
                        chat_template_kwargs={"greeting": "there"})[0]
    rendered = "TOOLS:get_weather;get_time;|<user>Hi there|<assistant>"
    plain = smollm2.generate(TokensPrompt(prompt_token_ids=smollm2.get_tokenizer().encode(rendered)), GREEDY,
                             use_tqdm=False)[0]
    assert chat.prompt_token_ids == plain.prompt_token_ids
    assert chat.outputs[0].token_ids == plain.outputs[0].token_ids


# -- generation_config.json ---------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_with_generation_config(tmp_path_factory):
    from model_fixtures import save_tiny_model

    folder = tmp_path_factory.mktemp("tiny-gen")
    save_tiny_model("llama", {}, folder)
    (folder / "generation_config.json").write_text(json.dumps(
        {"temperature": 0.0, "top_k": 5, "max_new_tokens": 3, "repetition_penalty": 1.2, "do_sample": True}))
    return folder


def _effective(llm: LLM, params: SamplingParams | None, rid: str = "probe") -> SamplingParams:
    """The SamplingParams the engine runs a request with."""
    llm.engine.add_request(rid, [1, 2, 3], params)
    try:
        return llm.engine._requests[rid].sequences[0].seq.params
    finally:
        llm.engine.abort_request(rid)


def test_generation_defaults_fill_only_what_a_request_leaves_unset(tiny_with_generation_config, tmp_path):
    llm = LLM(str(tiny_with_generation_config), device="cpu")
    assert llm.engine.sampling_defaults == {"temperature": 0.0, "top_k": 5, "repetition_penalty": 1.2,
                                            "max_tokens": 3}
    unset = _effective(llm, SamplingParams())
    assert (unset.temperature, unset.top_k, unset.repetition_penalty, unset.max_tokens) == (0.0, 5, 1.2, 3)
    assert unset.top_p == 1.0  # not in the file: SamplingParams' own default
    mine = _effective(llm, SamplingParams(temperature=1.0, max_tokens=16, top_k=0))  # equal to the defaults
    assert (mine.temperature, mine.top_k, mine.repetition_penalty, mine.max_tokens) == (1.0, 0, 1.2, 16)
    assert explicit_fields(mine) == {"temperature", "max_tokens", "top_k"}  # the user's, still
    out = llm.generate(TokensPrompt(prompt_token_ids=[4, 5, 6]), SamplingParams(ignore_eos=True),
                       use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == 3 and out.finish_reason == "length"  # max_new_tokens 3 applies
    assert llm.get_default_sampling_params().max_tokens == 3

    for setting in ("vllm", "none"):
        off = LLM(str(tiny_with_generation_config), device="cpu", generation_config=setting)
        assert off.engine.sampling_defaults == {}
        assert _effective(off, SamplingParams()).max_tokens == 16
    other = tmp_path / "other"
    other.mkdir()
    (other / "generation_config.json").write_text(json.dumps({"top_p": 0.5}))
    from_folder = LLM(str(tiny_with_generation_config), device="cpu", generation_config=str(other))
    assert _effective(from_folder, None).top_p == 0.5 and _effective(from_folder, None).max_tokens == 16
    with pytest.raises(ValueError, match="not auto, vllm or none, and not a folder"):
        LLM(str(tiny_with_generation_config), device="cpu", generation_config=str(tmp_path / "missing"))


# -- priority scheduling ------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from model_fixtures import save_tiny_model

    folder = tmp_path_factory.mktemp("tiny")
    save_tiny_model("llama", {}, folder)
    return str(folder)


def _finish_order(llm: LLM, priorities: list[int]) -> list[str]:
    """One sequence runs at a time (max_num_seqs 1): the order requests finish is the admission order."""
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    for i, priority in enumerate(priorities):
        engine.add_request(f"r{i}", [1 + i, 2, 3], params, priority=priority)
    order = []
    while engine.has_unfinished_requests():
        order += [o.request_id for o in engine.step() if o.finished]
    return order


def test_priority_policy_admits_lower_values_first(tiny):
    priority = LLM(tiny, device="cpu", max_num_seqs=1, scheduling_policy="priority")
    assert _finish_order(priority, [5, 0, 1, 0]) == ["r1", "r3", "r2", "r0"]  # ties: arrival order
    fcfs = LLM(tiny, device="cpu", max_num_seqs=1)
    assert fcfs.engine.config.scheduling_policy == "fcfs"
    assert _finish_order(fcfs, [0, 0, 0, 0]) == ["r0", "r1", "r2", "r3"]
    with pytest.raises(ValueError, match=r"priority=5 needs scheduling_policy='priority'.*runs fcfs"):
        fcfs.engine.add_request("x", [1, 2], GREEDY, priority=5)  # as vLLM: refused, not silently ignored
    assert not fcfs.engine.has_unfinished_requests()


def test_llm_generate_priority_keeps_output_order(tiny):
    llm = LLM(tiny, device="cpu", max_num_seqs=1, scheduling_policy="priority")
    prompts = [TokensPrompt(prompt_token_ids=[i + 1, 2]) for i in range(3)]
    outs = llm.generate(prompts, GREEDY, use_tqdm=False, priority=[2, 0, 1])
    assert [o.prompt_token_ids for o in outs] == [[1, 2], [2, 2], [3, 2]]
    scheduled = [o.metrics.first_scheduled_time for o in outs]
    assert scheduled[1] < scheduled[2] < scheduled[0]  # admitted by priority: 0, 1, then 2
    with pytest.raises(ValueError, match="2 priorities for 3 prompts"):
        llm.generate(prompts, GREEDY, priority=[0, 1])


def test_priority_reaches_the_engine_through_the_async_engine(tiny):
    """AsyncEngine.add(..., priority=) is what the server's request field goes through."""
    import asyncio

    from podium_server.thread_engine import ThreadEngine

    llm = LLM(tiny, device="cpu", max_num_seqs=1, scheduling_policy="priority")
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)

    async def go() -> list[str]:
        served = ThreadEngine(llm.engine)
        served.start()
        finished: list[str] = []
        try:
            # runs while the others arrive (one sequence at a time), so they all wait to be admitted
            blocker = await served.add("first", [9, 9, 9], SamplingParams(temperature=0, max_tokens=200,
                                                                           ignore_eos=True))
            streams = [await served.add(f"p{p}", [1, 2, 3], params, priority=p) for p in (3, 1, 2)]

            async def wait(stream):
                await stream.final()
                finished.append(stream.request_id)

            await asyncio.gather(wait(blocker), *(wait(s) for s in streams))
        finally:
            await served.stop()
        return finished

    assert asyncio.run(go()) == ["first", "p1", "p2", "p3"]
