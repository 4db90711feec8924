"""Structured output in the engine, on the real SmolLM2 (offline ``LLM``).

References: each backend's own matcher (xgrammar's ``GrammarMatcher``, llguidance's ``LLMatcher``)
driven directly over the same output, token by token, for the masks; ``jsonschema`` and ``re`` for
the outputs; the same engine without any grammar for the unconstrained rows of a mixed batch.
"""

from __future__ import annotations

import json
import re
import threading

import numpy as np
import pytest
import torch
from engine_fixtures import smollm2_gguf

jsonschema = pytest.importorskip("jsonschema")
xgr = pytest.importorskip("xgrammar")
llg = pytest.importorskip("llguidance")

from podium import LLM, SamplingParams  # noqa: E402
from podium.errors import InvalidParameter  # noqa: E402
from podium.request import Sequence  # noqa: E402
from podium.sampling_params import StructuredOutputsParams  # noqa: E402
from podium.structured import GrammarMasks  # noqa: E402

pytestmark = pytest.mark.slow

PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 12},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "role": {"enum": ["admin", "user", "guest"]}}, "required": ["name", "age", "role"], "additionalProperties": False}
DATE = r"\d{4}-\d{2}-\d{2}"
CHOICES = ["red", "green", "blue"]
EBNF = 'root ::= "yes" | "no" | "maybe"'
PROMPTS = ["Describe a person as JSON:", "Today's date is", "My favourite colour is", "Is the sky blue?"]


@pytest.fixture(scope="module")
def llm():
    return LLM(str(smollm2_gguf()), dtype="float32", max_num_seqs=16, seed=0)


def constrained(backend: str | None = None, max_tokens: int = 48, **kind) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens,
                          structured_outputs=StructuredOutputsParams(**kind, backend=backend))


@pytest.mark.parametrize("backend", ["xgrammar", "llguidance"])
def test_outputs_follow_their_grammar(llm, backend):
    params = [constrained(backend, json=PERSON), constrained(backend, regex=DATE),
              constrained(backend, choice=CHOICES), constrained(backend, json_object=True, max_tokens=64)]
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    person, date, colour, obj = (o.outputs[0] for o in outs)
    assert all(c.finish_reason == "stop" for c in (person, date, colour)), [c.finish_reason for c in outs]
    jsonschema.validate(json.loads(person.text), PERSON)
    assert re.fullmatch(DATE, date.text), date.text
    assert colour.text in CHOICES
    if obj.finish_reason == "stop":
        assert isinstance(json.loads(obj.text), dict)
    if backend == "xgrammar":  # EBNF is xgrammar's grammar language (llguidance reads Lark)
        (out,) = llm.generate(["Answer yes, no or maybe:"], constrained(backend, grammar=EBNF), use_tqdm=False)
        assert out.outputs[0].text in ("yes", "no", "maybe")


def _unpack(bitmask: np.ndarray, vocab: int) -> np.ndarray:
    """Reference unpacking of an int32 bitmask row: bit i of word j is token 32 j + i."""
    return np.unpackbits(bitmask.astype("<i4").view(np.uint8), bitorder="little")[:vocab].astype(bool)


@pytest.mark.parametrize("backend", ["xgrammar", "llguidance"])
def test_masks_equal_the_backends_matcher(llm, backend):
    """At every position of a sampled output, the sampler's mask (after unpacking, as applied to the
    logits) equals the mask of the backend's own matcher driven directly over the same tokens."""
    engine = llm.engine
    vocab = engine.source.hf_config.vocab_size
    params = SamplingParams(temperature=1.0, seed=7, max_tokens=40,
                            structured_outputs=StructuredOutputsParams(json=PERSON, backend=backend))
    (out,) = llm.generate(["A person:"], params, use_tqdm=False)
    tokens = list(out.outputs[0].token_ids)
    if backend == "xgrammar":
        info = xgr.TokenizerInfo.from_huggingface(engine.tokenizer, vocab_size=vocab,
                                                  stop_token_ids=engine.source.eos_token_ids)
        reference = xgr.GrammarMatcher(xgr.GrammarCompiler(info).compile_json_schema(
            json.dumps(PERSON), any_whitespace=False, strict_mode=True))

        def reference_mask() -> np.ndarray:
            mask = xgr.allocate_token_bitmask(1, vocab)
            reference.fill_next_token_bitmask(mask, 0)
            return _unpack(mask[0].numpy(), vocab)
        accept, ended = reference.accept_token, reference.is_terminated
    else:
        import llguidance.hf
        import llguidance.torch
        tok = llguidance.hf.from_tokenizer(engine.tokenizer, n_vocab=vocab, eos_token=engine.source.eos_token_ids[0])
        grammar = llg.LLMatcher.grammar_from_json_schema(json.dumps(PERSON),
                                                         defaults={"whitespace_flexible": False})
        reference = llg.LLMatcher(tok, grammar)

        def reference_mask() -> np.ndarray:
            mask = llguidance.torch.allocate_token_bitmask(1, vocab)
            llguidance.torch.fill_next_token_bitmask(reference, mask, 0)
            return _unpack(mask[0].numpy(), vocab)
        accept, ended = reference.consume_token, reference.is_stopped
    grammar = engine.grammars.request(params.structured_outputs)
    seq = Sequence(0, "mask-check", 0, [1, 2, 3], params, grammar=grammar)
    masks = GrammarMasks(vocab)
    for position in range(len(tokens) + 1):
        if ended():  # the grammar has ended (on EOS): nothing more to mask
            break
        seq.token_ids = [1, 2, 3, *tokens[:position]]
        logits = torch.zeros(1, vocab)
        masks.apply(logits, [0], [seq])
        ours = torch.isfinite(logits[0]).numpy()
        expected = reference_mask()
        assert np.array_equal(ours, expected), f"position {position}: {np.flatnonzero(ours != expected)[:10]}"
        if position < len(tokens):
            assert expected[tokens[position]], f"the output's token {position} is outside the reference mask"
            assert accept(tokens[position])
    if out.outputs[0].finish_reason == "stop":
        jsonschema.validate(json.loads(out.outputs[0].text), PERSON)


def test_unconstrained_rows_are_unchanged(llm):
    """Greedy and seeded rows give the same tokens with or without constrained rows beside them."""
    plain = [SamplingParams(temperature=0.0, max_tokens=24), SamplingParams(temperature=0.8, seed=3, max_tokens=24)]
    prompts = ["The capital of France is", "Once upon a time"]
    alone = llm.generate(prompts, plain, use_tqdm=False)
    mixed = llm.generate(prompts + PROMPTS[:2], plain + [constrained(json=PERSON), constrained(regex=DATE)],
                         use_tqdm=False)
    for a, m in zip(alone, mixed[:2]):
        assert a.outputs[0].token_ids == m.outputs[0].token_ids


def test_n_chunked_prefill_preemption_and_async_scheduling():
    """n > 1, prompts split into chunks, sequences preempted and recomputed, async scheduling on:
    every sample still follows its grammar, and greedy ones equal a roomy engine's."""
    small = LLM(str(smollm2_gguf()), dtype="float32", max_num_seqs=8, max_num_batched_tokens=16, num_kv_blocks=26, max_model_len=96,
                block_size=4, async_scheduling=True, seed=0)
    long_prompt = "Here is a long introduction about people and their records. " * 3 + "A person:"
    params = [SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=40,
                             structured_outputs=StructuredOutputsParams(json=PERSON)),
              constrained(json=PERSON, max_tokens=40), constrained(regex=DATE), SamplingParams(max_tokens=20,
                                                                                               temperature=0.0)]
    prompts = [long_prompt, PROMPTS[0], PROMPTS[1], "The quick brown fox"]
    outs = small.generate(prompts, params, use_tqdm=False)
    assert small.engine.stats().num_preemptions > 0
    assert small.engine.stats().num_free_blocks == small.engine.stats().num_total_blocks
    assert len(outs[0].outputs) == 3
    for c in [*outs[0].outputs, outs[1].outputs[0]]:
        if c.finish_reason == "stop":
            jsonschema.validate(json.loads(c.text), PERSON)
    assert re.fullmatch(DATE, outs[2].outputs[0].text)
    roomy = LLM(str(smollm2_gguf()), dtype="float32", max_num_seqs=8, seed=0)
    again = roomy.generate(prompts[1:], params[1:], use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs[1:]] == [o.outputs[0].token_ids for o in again]


def test_bad_constraints_are_refused_with_the_reason(llm):
    with pytest.raises(InvalidParameter, match="regex"):
        llm.engine.add_request("bad-regex", "x", constrained(regex="(unclosed"))
    with pytest.raises(InvalidParameter, match="JSON schema"):
        llm.engine.add_request("bad-schema", "x", constrained(json={"type": "object", "properties": {"a": {"type": 3}}}))
    with pytest.raises(InvalidParameter, match="patternProperties"):
        llm.engine.add_request("unsupported", "x", constrained(json={"type": "object",
                                                                     "patternProperties": {"^a": {"type": "string"}}}))
    with pytest.raises(InvalidParameter, match="exactly one"):
        llm.engine.add_request("two", "x", constrained(regex="a", choice=["a"]))
    assert not llm.engine.has_unfinished_requests()


def test_compilation_is_off_the_step_path_and_cached(llm):
    """A request whose grammar is still compiling waits outside the scheduler while the others step;
    the same spec again is a cache hit (no new compilation)."""
    engine = llm.engine
    backend = engine.grammars.backend("xgrammar")
    release = threading.Event()
    compile_ = backend.compile
    schema = {"type": "object", "properties": {"slow": {"type": "boolean"}}, "required": ["slow"]}

    def slow_compile(spec):
        release.wait(30)
        return compile_(spec)

    backend.compile = slow_compile
    try:
        before = engine.grammars.compilations
        engine.add_request("slow", "Answer as JSON:", constrained(json=schema, max_tokens=16))
        engine.add_request("plain", "Hello", SamplingParams(temperature=0.0, max_tokens=4))
        finished = set()
        for _ in range(10):
            finished |= {o.request_id for o in engine.step() if o.finished}
        assert finished == {"plain"}  # it ran to the end while the grammar compiled
        release.set()
        while engine.has_unfinished_requests():
            for o in engine.step():
                if o.finished:
                    assert o.outputs[0].finish_reason == "stop"
                    assert isinstance(json.loads(o.outputs[0].text)["slow"], bool)
        assert engine.grammars.compilations == before + 1
        engine.grammars.request(StructuredOutputsParams(json=json.dumps(schema, indent=2)))  # same spec, as text
        assert engine.grammars.compilations == before + 1
    finally:
        backend.compile = compile_
        release.set()


def test_masks_apply_to_replayed_graph_steps():
    """On a platform that captures decode graphs, constrained decode steps replay them (the mask is
    applied to the replayed logits, never captured) and still follow the grammar; unconstrained rows
    beside them keep their tokens."""
    graphs = LLM(str(smollm2_gguf()), dtype="bfloat16", max_num_seqs=8, seed=0)
    runner = graphs.engine.runner
    if not runner.graphs:
        pytest.skip("this CPU captures no decode graphs (no native bf16 kernels)")
    replayed = []
    execute = runner.execute

    def counting(plan, feed_tokens=None):
        result = execute(plan, feed_tokens)
        replayed.append(result.used_graph)
        return result

    runner.execute = counting
    plain = SamplingParams(temperature=0.0, max_tokens=16)
    alone = graphs.generate(["The capital of France is"], plain, use_tqdm=False)
    replayed.clear()
    mixed = graphs.generate(["The capital of France is", PROMPTS[0]], [plain, constrained(json=PERSON)],
                            use_tqdm=False)
    assert sum(replayed) >= 8  # the decode steps of the constrained batch replayed a graph
    assert mixed[0].outputs[0].token_ids == alone[0].outputs[0].token_ids
    person = mixed[1].outputs[0]
    assert person.finish_reason == "stop"
    jsonschema.validate(json.loads(person.text), PERSON)


@pytest.mark.parametrize("backend", ["xgrammar", "llguidance"])
def test_end_ids_past_the_vocabulary_are_dropped(llm, backend):
    """A shape config over a smaller tokenizer can name end ids the logits do not have (llguidance refused
    to build at all); the backend keeps the ids it can use, so a finished grammar still allows the end."""
    from podium.structured.backend import GrammarSpec
    from podium.structured.service import make_backend
    engine = llm.engine
    vocab = engine.source.hf_config.vocab_size
    eos = engine.source.eos_token_ids[0]
    grammars = make_backend(backend, engine.tokenizer, vocab, [eos, vocab + 128_000])
    matcher = grammars.matcher(grammars.compile(GrammarSpec.from_params(StructuredOutputsParams(choice=["yes"]))))
    for token in engine.tokenizer.encode("yes", add_special_tokens=False):
        assert matcher.accept(token)
    mask = torch.zeros(1, (vocab + 31) // 32, dtype=torch.int32)
    matcher.fill_bitmask(mask, 0)
    allowed = np.flatnonzero(_unpack(mask[0].numpy(), vocab))
    assert allowed.tolist() == [eos]


@pytest.mark.parametrize("backend", ["xgrammar", "llguidance"])
def test_batched_fill_equals_row_by_row(llm, backend):
    """The threaded many-row fill writes each matcher's mask into its own row, whatever the order of
    the rows, exactly as the one-row fill does (a mixed-up row would let a sequence break its grammar)."""
    from podium.structured.backend import GrammarSpec
    from podium.structured.service import make_backend
    engine = llm.engine
    vocab = engine.source.hf_config.vocab_size
    grammars = make_backend(backend, engine.tokenizer, vocab, engine.source.eos_token_ids)
    compiled = grammars.compile(GrammarSpec.from_params(StructuredOutputsParams(json=PERSON)))
    (out,) = llm.generate(["Describe a person as JSON:"], constrained(backend, json=PERSON), use_tqdm=False)
    tokens = list(out.outputs[0].token_ids)
    matchers = []
    for n in range(len(tokens)):  # matcher n has taken the first n tokens: a different mask each
        matcher = grammars.matcher(compiled)
        assert all(matcher.accept(t) for t in tokens[:n])
        matchers.append(matcher)
    words = (vocab + 31) // 32
    one_by_one = torch.full((len(matchers), words), -1, dtype=torch.int32)
    for row, matcher in enumerate(matchers):
        matcher.fill_bitmask(one_by_one, row)
    rows = [2 * (len(matchers) - 1 - i) + 1 for i in range(len(matchers))]  # reversed, with gaps
    batched = torch.full((2 * len(matchers) + 1, words), -1, dtype=torch.int32)
    type(matchers[0]).fill_bitmasks(matchers, batched, rows)
    assert len({bytes(one_by_one[i].numpy()) for i in range(len(matchers))}) > 3  # the masks do differ
    for i, row in enumerate(rows):
        assert torch.equal(batched[row], one_by_one[i]), f"matcher {i} (row {row})"
    untouched = sorted(set(range(batched.shape[0])) - set(rows))
    assert bool((batched[untouched] == -1).all())


def test_constrained_steps_are_deferred_and_equal_synchronous(llm, monkeypatch):
    """With async scheduling a constrained row samples while its previous token is still in flight:
    the matcher takes that token from the step in flight. Such steps really are deferred, and every
    output (greedy and seeded) equals the synchronous engine's token for token."""
    import podium.engine as engine_module
    deferred_constrained = []
    launch = engine_module.launch

    def counting_launch(sampler, logits, seqs, *args, **kwargs):
        deferred_constrained.append(sum(s.grammar is not None for s in seqs))
        return launch(sampler, logits, seqs, *args, **kwargs)

    monkeypatch.setattr(engine_module, "launch", counting_launch)
    eager = LLM(str(smollm2_gguf()), dtype="float32", max_num_seqs=16, seed=0, async_scheduling=True)
    params = [constrained(json=PERSON), constrained(regex=DATE), constrained("llguidance", choice=CHOICES),
              SamplingParams(temperature=0.8, seed=3, max_tokens=40,
                             structured_outputs=StructuredOutputsParams(json_object=True))]
    outs = eager.generate(PROMPTS, params, use_tqdm=False)
    assert eager.engine.async_scheduling and sum(deferred_constrained) > 20, deferred_constrained
    again = llm.generate(PROMPTS, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in again]
    jsonschema.validate(json.loads(outs[0].outputs[0].text), PERSON)
