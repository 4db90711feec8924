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
from podium.sampling_params import ReasoningMarkers, StructuredOutputsParams  # noqa: E402
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


class Reference:
    """The backend's own matcher of a constraint, built from the library directly (a choice as the
    library's own alternatives, not through our regex): its mask as booleans, accept, ended."""

    def __init__(self, engine, backend: str, kind: str, value) -> None:
        vocab = self.vocab = engine.source.hf_config.vocab_size
        if backend == "xgrammar":
            info = xgr.TokenizerInfo.from_huggingface(engine.tokenizer, vocab_size=vocab,
                                                      stop_token_ids=engine.source.eos_token_ids)
            compiler = xgr.GrammarCompiler(info)
            compiled = {"json": lambda: compiler.compile_json_schema(json.dumps(value), any_whitespace=False,
                                                                     strict_mode=True),
                        "regex": lambda: compiler.compile_regex(value),
                        "choice": lambda: compiler.compile_grammar(
                            "root ::= " + " | ".join(json.dumps(c) for c in value)),
                        "grammar": lambda: compiler.compile_grammar(value)}[kind]()
            self.matcher = xgr.GrammarMatcher(compiled)
            self.accept, self.ended = self.matcher.accept_token, self.matcher.is_terminated
        else:
            import llguidance.hf
            tok = llguidance.hf.from_tokenizer(engine.tokenizer, n_vocab=vocab, eos_token=engine.source.eos_token_ids[0])
            grammar = {"json": lambda: llg.LLMatcher.grammar_from_json_schema(
                           json.dumps(value), defaults={"whitespace_flexible": False}),
                       "regex": lambda: llg.LLMatcher.grammar_from_regex(value),
                       "choice": lambda: llg.LLMatcher.grammar_from_lark(
                           "start: " + " | ".join(json.dumps(c) for c in value)),
                       "grammar": lambda: llg.LLMatcher.grammar_from_lark(value)}[kind]()
            self.matcher = llg.LLMatcher(tok, grammar)
            self.accept, self.ended = self.matcher.consume_token, self.matcher.is_stopped
        self.backend = backend

    def mask(self) -> np.ndarray:
        if self.backend == "xgrammar":
            mask = xgr.allocate_token_bitmask(1, self.vocab)
            self.matcher.fill_next_token_bitmask(mask, 0)
        else:
            import llguidance.torch
            mask = llguidance.torch.allocate_token_bitmask(1, self.vocab)
            llguidance.torch.fill_next_token_bitmask(self.matcher, mask, 0)
        return _unpack(mask[0].numpy(), self.vocab)


def our_mask(masks: GrammarMasks, seq: Sequence, prompt: list[int], output: list[int]) -> np.ndarray:
    """The sampler's mask for ``seq`` after ``output``, as applied to logits (True: allowed)."""
    seq.token_ids = [*prompt, *output]
    logits = torch.zeros(1, masks.vocab_size)
    masks.apply(logits, [0], [seq])
    return torch.isfinite(logits[0]).numpy()


def check_masks(engine, params: SamplingParams, prompt: list[int], tokens: list[int], reference: Reference,
                answer_start: int = 0, undecided: int | None = None) -> None:
    """At every position of ``tokens``: no mask before ``answer_start`` (the reasoning), the reference
    matcher's mask from there on, driven over the answer's tokens (``undecided``: the token an
    undecided first position allows besides the grammar's)."""
    grammar = engine.grammars.request(params.structured_outputs)
    seq = Sequence(0, "mask-check", 0, list(prompt), params, grammar=grammar)
    masks = GrammarMasks(reference.vocab)
    for position in range(len(tokens) + 1):
        if position >= answer_start and reference.ended():  # the grammar has ended (on EOS)
            break
        ours = our_mask(masks, seq, prompt, tokens[:position])
        if position < answer_start and not (position == 0 and undecided is not None):
            assert ours.all(), f"position {position} (reasoning) is masked"
            continue
        expected = reference.mask()
        if undecided is not None and position == 0:
            expected = expected.copy()
            expected[undecided] = True
        assert np.array_equal(ours, expected), f"position {position}: {np.flatnonzero(ours != expected)[:10]}"
        if answer_start <= position < len(tokens):
            assert expected[tokens[position]], f"the output's token {position} is outside the reference mask"
            assert reference.accept(tokens[position])


KINDS = [("json", PERSON, "A person:"), ("regex", DATE, "Today's date is"), ("choice", CHOICES, "My colour:")]


@pytest.mark.parametrize("backend", ["xgrammar", "llguidance"])
@pytest.mark.parametrize("kind,value,prompt", [*KINDS, ("grammar", None, "Is it? Answer:")],
                         ids=["json", "regex", "choice", "grammar"])
def test_masks_equal_the_backends_matcher(llm, backend, kind, value, prompt):
    """At every position of a sampled output, the sampler's mask (after unpacking, as applied to the
    logits) equals the mask of the backend's own matcher driven directly over the same tokens."""
    if kind == "grammar":  # xgrammar reads EBNF, llguidance Lark
        value = EBNF if backend == "xgrammar" else 'start: "yes" | "no" | "maybe"'
    params = SamplingParams(temperature=1.0, seed=7, max_tokens=40,
                            structured_outputs=StructuredOutputsParams(**{kind: value}, backend=backend))
    (out,) = llm.generate([prompt], params, use_tqdm=False)
    tokens = list(out.outputs[0].token_ids)
    check_masks(llm.engine, params, [1, 2, 3], tokens, Reference(llm.engine, backend, kind, value))
    text = out.outputs[0].text
    if out.outputs[0].finish_reason == "stop":
        if kind == "json":
            jsonschema.validate(json.loads(text), PERSON)
        elif kind == "regex":
            assert re.fullmatch(DATE, text)
        else:
            assert text in (CHOICES if kind == "choice" else ("yes", "no", "maybe"))


# -- after the reasoning ---------------------------------------------------------------------------
# SmolLM2 copies a pattern it was shown: two worked examples make it think inside <think></think>
# before its JSON answer, so the reasoning comes from the model itself, with no logits forced.
CAPITAL = {"type": "object", "properties": {"capital": {"type": "string", "maxLength": 12}},
           "required": ["capital"], "additionalProperties": False}
_SHOT = ("<|im_start|>user\nCapital of {0}?<|im_end|>\n<|im_start|>assistant\n<think>\nThe capital of {0} is {1}."
         "\n</think>\n{{\"city\": \"{1}\"}}<|im_end|>\n")
FEW_SHOT = ("<|im_start|>system\nThink inside <think></think>, then answer with JSON.<|im_end|>\n"
            + _SHOT.format("France", "Paris") + _SHOT.format("Spain", "Madrid")
            + "<|im_start|>user\nCapital of Italy?<|im_end|>\n<|im_start|>assistant\n")
THINKING = FEW_SHOT + "<think>\n"  # the template opened the section (DeepSeek R1's does)
NOT_THINKING = FEW_SHOT + "<think>\n\n</think>\n"  # it closed an empty one (Qwen3, enable_thinking: false)


def markers(tokenizer, optional: bool = False) -> ReasoningMarkers:
    ids = [tokenizer.encode(m, add_special_tokens=False) for m in ("<think>", "</think>")]
    return ReasoningMarkers(*ids, optional=optional)


def after_reasoning(tokenizer, optional: bool = False, max_tokens: int = 60, **constraint) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, structured_outputs=StructuredOutputsParams(
        **constraint, reasoning=markers(tokenizer, optional)))


def split_answer(tokenizer, tokens: list[int]) -> int:
    """The index of the answer's first token: after the first </think> in ``tokens``."""
    end = tokenizer.encode("</think>", add_special_tokens=False)
    for i in range(len(tokens)):
        if tokens[i:i + len(end)] == end:
            return i + len(end)
    raise AssertionError("the output never closed its reasoning")


def test_the_grammar_applies_after_the_reasoning(llm):
    """A prompt that opens the reasoning section: the model reasons unconstrained (its tokens equal
    the unconstrained output's up to </think>), then answers in the schema; the masks are off before
    </think> and equal xgrammar's own matcher's after it, token by token."""
    tok = llm.engine.tokenizer
    params = after_reasoning(tok, json=CAPITAL)
    (free,), (gated,) = (llm.generate([THINKING], p, use_tqdm=False)
                         for p in (SamplingParams(temperature=0.0, max_tokens=60), params))
    tokens = list(gated.outputs[0].token_ids)
    answer = split_answer(tok, tokens)
    assert answer > 4 and tokens[:answer] == list(free.outputs[0].token_ids[:answer])
    assert gated.outputs[0].finish_reason == "stop"
    reasoning, _, content = gated.outputs[0].text.partition("</think>")
    assert "Rome" in reasoning
    jsonschema.validate(json.loads(content), CAPITAL)  # (unconstrained, it answers {"city": ...})
    check_masks(llm.engine, params, tok.encode(THINKING), tokens, Reference(llm.engine, "xgrammar", "json", CAPITAL),
                answer_start=answer)


def test_a_prompt_that_closed_the_reasoning_is_answered_at_once(llm):
    """Qwen3's template with enable_thinking false closes an empty think block in the prompt: the
    grammar applies from the first token (for either parser's markers)."""
    tok = llm.engine.tokenizer
    prompt = tok.encode(NOT_THINKING)
    for optional in (False, True):
        params = after_reasoning(tok, optional, json=CAPITAL)
        (out,) = llm.generate([NOT_THINKING], params, use_tqdm=False)
        assert out.outputs[0].finish_reason == "stop"
        jsonschema.validate(json.loads(out.outputs[0].text), CAPITAL)
        check_masks(llm.engine, params, prompt, list(out.outputs[0].token_ids),
                    Reference(llm.engine, "xgrammar", "json", CAPITAL))


def test_an_optional_section_is_decided_by_the_first_token(llm):
    """Qwen3's parser reasons only when the output opens with <think>: with no marker in the prompt the
    first position allows the grammar's tokens and <think>'s first; opening it defers the grammar to
    after </think> (an empty block too); anything else is the answer. A rewound output (a sequence
    replayed from its tokens) gets its state back."""
    tok = llm.engine.tokenizer
    prompt = tok.encode("Capital of Italy as JSON:")
    params = after_reasoning(tok, optional=True, json=CAPITAL)
    start = markers(tok).start
    answer = tok.encode('{"capital": "Rome"}', add_special_tokens=False)
    for thinking in ("<think>\nItaly: Rome.\n</think>", "<think>\n\n</think>", ""):
        reasoning = tok.encode(thinking, add_special_tokens=False)
        check_masks(llm.engine, params, prompt, reasoning + answer, Reference(llm.engine, "xgrammar", "json", CAPITAL),
                    answer_start=len(reasoning), undecided=start[0])
    (out,) = llm.generate(["Capital of Italy as JSON:"], params, use_tqdm=False)  # no <think>: the answer at once
    jsonschema.validate(json.loads(out.outputs[0].text), CAPITAL)
    # a rewind: back inside the reasoning, the row is unmasked again; forward, masked as before
    reasoning = tok.encode("<think>\nRome.\n</think>", add_special_tokens=False)
    seq = Sequence(0, "rewind", 0, list(prompt), params, grammar=llm.engine.grammars.request(params.structured_outputs))
    masks = GrammarMasks(llm.engine.source.hf_config.vocab_size)
    full = reasoning + answer[:3]
    masked = our_mask(masks, seq, prompt, full)
    assert not masked.all()
    assert our_mask(masks, seq, prompt, reasoning[:4]).all()
    assert np.array_equal(our_mask(masks, seq, prompt, full), masked)


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
                             structured_outputs=StructuredOutputsParams(json_object=True)),
              after_reasoning(llm.engine.tokenizer, json=CAPITAL)]  # the gate opens on a token in flight
    prompts = [*PROMPTS, THINKING]
    outs = eager.generate(prompts, params, use_tqdm=False)
    assert eager.engine.async_scheduling and sum(deferred_constrained) > 20, deferred_constrained
    again = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in again]
    jsonschema.validate(json.loads(outs[0].outputs[0].text), PERSON)
    jsonschema.validate(json.loads(outs[-1].outputs[0].text.partition("</think>")[2]), CAPITAL)


def test_prefix_cache_hits_keep_the_constraint(llm):
    """A prompt whose blocks are cached (the same prompt again, or a longer one sharing its prefix)
    is still constrained from its first output token: the grammar lives with the sequence, not the KV."""
    prefix = "A register of the people who work at the lighthouse, their ages and their roles. " * 3
    params = constrained(json=PERSON)
    (first,) = llm.generate([prefix + "The keeper:"], params, use_tqdm=False)
    (again,) = llm.generate([prefix + "The keeper:"], params, use_tqdm=False)
    (other,) = llm.generate([prefix + "The cook:"], params, use_tqdm=False)
    assert first.num_cached_tokens == 0 and again.num_cached_tokens > 0 and other.num_cached_tokens > 0
    assert again.outputs[0].token_ids == first.outputs[0].token_ids
    for out in (first, other):
        assert out.outputs[0].finish_reason == "stop"
        jsonschema.validate(json.loads(out.outputs[0].text), PERSON)


def test_speculative_decoding_keeps_the_grammar(llm):
    """With n-gram speculation each verified draft position is sampled under the grammar's mask at
    that position (and the reasoning gate's state there): greedy output equals plain decoding's,
    token for token, and validates; drafts were accepted on the way."""
    spec = LLM(str(smollm2_gguf()), dtype="float32", max_num_seqs=16, seed=0, speculative_config={
        "method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1})
    prompts = [PROMPTS[0], THINKING]
    params = [constrained(json=PERSON), after_reasoning(llm.engine.tokenizer, json=CAPITAL)]
    outs = spec.generate(prompts, params, use_tqdm=False)
    plain = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in plain]
    assert spec.engine.stats().spec_decoding.num_accepted_tokens > 0
    jsonschema.validate(json.loads(outs[0].outputs[0].text), PERSON)
    jsonschema.validate(json.loads(outs[1].outputs[0].text.partition("</think>")[2]), CAPITAL)
