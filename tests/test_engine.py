"""Engine properties on the real SmolLM2 model (float32, CPU): invariance, caching, leaks, errors."""

from __future__ import annotations

import random

import pytest
import torch
from engine_fixtures import GOLDEN_PROMPTS, smollm2_gguf

from podium import LLM, SamplingParams
from podium.engine import LLMEngine

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


def make_llm(**kwargs) -> LLM:
    smollm2_gguf()
    return LLM("smollm2-135m-instruct", dtype="float32", device="cpu", **kwargs)


@pytest.fixture(scope="module")
def llm():
    return make_llm()


def token_ids(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def all_blocks_free(engine: LLMEngine) -> bool:
    stats = engine.stats()
    return stats.num_free_blocks == stats.num_total_blocks and stats.num_running == stats.num_waiting == 0


def mixed_batch(tokenizer, targets: list[str], size: int = 32) -> tuple[list[str], list[SamplingParams]]:
    rng = random.Random(0)
    words = "alpha beta gamma delta river mountain code python music light".split()
    prompts, params = list(targets), [GREEDY] * len(targets)
    while len(prompts) < size:
        prompts.append(" ".join(rng.choice(words) for _ in range(rng.randint(2, 40))))
        params.append(SamplingParams(temperature=rng.choice([0, 0.8]), max_tokens=rng.randint(1, 30),
                                     seed=rng.randint(0, 99), ignore_eos=True))
    order = list(range(size))
    rng.shuffle(order)
    return [prompts[i] for i in order], [params[i] for i in order]


@pytest.fixture(scope="module")
def reference_outputs(llm):
    return {p: token_ids(llm.generate([p], GREEDY, use_tqdm=False))[0] for p in GOLDEN_PROMPTS[:3]}


def check_against_reference(llm: LLM, reference: dict[str, list[int]]) -> None:
    prompts, params = mixed_batch(llm.get_tokenizer(), list(reference))
    outs = llm.generate(prompts, params, use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        if prompt in reference:
            assert out.outputs[0].token_ids == reference[prompt], prompt
    assert all_blocks_free(llm.engine)


def test_greedy_is_batch_invariant(llm, reference_outputs):
    check_against_reference(llm, reference_outputs)


def test_greedy_is_chunk_size_invariant(reference_outputs):
    small = make_llm(max_num_batched_tokens=16, max_num_seqs=8)
    check_against_reference(small, reference_outputs)


def test_greedy_is_preemption_invariant(reference_outputs):
    scarce = make_llm(num_kv_blocks=20, max_model_len=256)
    check_against_reference(scarce, reference_outputs)
    assert scarce.engine.stats().num_preemptions > 0


def test_prefix_cache_hits_are_counted_and_change_nothing():
    system = "You are a helpful assistant who answers questions about geography in detail. " * 3
    questions = [system + q for q in ("Where is Peru?", "Where is Chad?", "Where is Laos?")]
    results = {}
    for caching in (True, False):
        llm = make_llm(enable_prefix_caching=caching)
        tok = llm.get_tokenizer()
        shared = len(tok.encode(system))
        first = llm.generate([questions[0]], GREEDY, use_tqdm=False)
        before = llm.engine.stats()
        rest = llm.generate(questions[1:], GREEDY, use_tqdm=False)
        after = llm.engine.stats()
        results[caching] = token_ids(first + rest)
        if caching:
            expected = 2 * (shared // 16) * 16  # each later question reuses the system prompt's full blocks
            assert after.prefix_cache_hits - before.prefix_cache_hits == expected
            assert rest[0].num_cached_tokens == (shared // 16) * 16
        else:
            assert after.prefix_cache_hits == 0
        assert all_blocks_free(llm.engine)
    assert results[True] == results[False]


def test_prompt_logprobs_cover_the_whole_prompt_after_a_prefix_hit(llm):
    """A request that asks for prompt logprobs gets one entry per prompt token (None first) even when
    its prompt is already in the prefix cache, equal to the entries computed without the cache."""
    prompt = "You are a helpful assistant who answers questions about geography in detail. " * 3
    asks = SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=2)
    llm.generate([prompt], GREEDY, use_tqdm=False)  # the prompt's full blocks are cached now
    hit = llm.generate([prompt], asks, use_tqdm=False)[0]
    fresh = make_llm(enable_prefix_caching=False).generate([prompt], asks, use_tqdm=False)[0]
    assert len(hit.prompt_logprobs) == len(hit.prompt_token_ids) > 32
    assert hit.prompt_logprobs[0] is None
    for got, want in zip(hit.prompt_logprobs[1:], fresh.prompt_logprobs[1:]):
        assert got.keys() == want.keys()
        assert all(abs(got[t].logprob - want[t].logprob) < 1e-4 for t in got)
    assert all_blocks_free(llm.engine)


def test_abort_frees_every_block(llm):
    engine = llm.engine
    for i in range(6):
        engine.add_request(f"abort-{i}", GOLDEN_PROMPTS[i % len(GOLDEN_PROMPTS)] * (i + 1),
                           SamplingParams(max_tokens=50, ignore_eos=True))
    for _ in range(3):
        engine.step()
    engine.abort_request([f"abort-{i}" for i in range(0, 6, 2)])
    engine.step()
    engine.abort_request([f"abort-{i}" for i in range(1, 6, 2)])
    assert not engine.has_unfinished_requests()
    assert all_blocks_free(engine)


def test_stats_give_a_router_the_queued_work_and_the_prefill_rate(llm):
    engine, tok = llm.engine, llm.get_tokenizer()
    prompts = [f"Router accounting {word}: " + "the quick brown fox jumps. " * n for word, n in (("one", 9), ("two", 4))]
    lens = [len(tok.encode(p)) for p in prompts]
    before = engine.stats()
    for i, prompt in enumerate(prompts):
        engine.add_request(f"router-{i}", prompt, SamplingParams(max_tokens=3, ignore_eos=True))
    assert (engine.stats().queued_tokens, engine.stats().running_tokens) == (sum(lens), 0)
    engine.step()  # both prompts fit the token budget: prefilled, one token sampled each
    stats = engine.stats()
    assert stats.prefill_tokens - before.prefill_tokens == sum(lens)  # distinct prompts: no cache hits
    assert stats.prefill_seconds > before.prefill_seconds
    assert (stats.queued_tokens, stats.running_tokens) == (2, sum(lens) + 2)  # one decode each, next
    while engine.has_unfinished_requests():
        engine.step()
    after = engine.stats()
    assert after.prefill_tokens == stats.prefill_tokens and after.prefill_seconds == stats.prefill_seconds
    assert after.queued_tokens == after.running_tokens == 0
    # a waiting prompt whose leading blocks the prefix cache holds: only the rest is queued work
    block_size = engine.block_manager.block_size
    longer = tok.encode(prompts[0]) + tok.encode(" and then some more words", add_special_tokens=False)
    engine.add_request("router-cached", longer, SamplingParams(max_tokens=1))
    cached = lens[0] // block_size * block_size  # prompt 0's full blocks, computed above
    assert cached and engine.stats().queued_tokens == len(longer) - cached
    while engine.has_unfinished_requests():
        engine.step()


def test_seeded_sampling_is_reproducible_and_independent_of_company(llm):
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=20, ignore_eos=True)
    alone = token_ids(llm.generate(["Tell me a story"], params, use_tqdm=False))[0]
    prompts, others = mixed_batch(llm.get_tokenizer(), [], 12)
    crowd = llm.generate(["Tell me a story", *prompts], [params, *others], use_tqdm=False)
    assert crowd[0].outputs[0].token_ids == alone


def test_n_samples_share_the_prompt_blocks(llm):
    engine = llm.engine
    prompt = "The history of the Roman empire is long and complicated, " * 4
    before = engine.stats().prefix_cache_hits
    out = llm.generate([prompt], SamplingParams(n=4, temperature=1.0, seed=7, max_tokens=8), use_tqdm=False)[0]
    full_blocks = len(llm.get_tokenizer().encode(prompt)) // 16
    assert len(out.outputs) == 4 and [o.index for o in out.outputs] == [0, 1, 2, 3]
    assert engine.stats().prefix_cache_hits - before >= 3 * full_blocks * 16
    assert len({tuple(o.token_ids) for o in out.outputs}) > 1
    assert all_blocks_free(engine)


def test_logprobs_match_log_softmax_of_transformers():
    from transformers import AutoModelForCausalLM

    path = smollm2_gguf()
    llm = make_llm()
    hf = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    ids = llm.get_tokenizer().encode("The capital of France is")
    out = llm.generate([{"prompt_token_ids": ids}], SamplingParams(temperature=0, max_tokens=1, logprobs=5),
                       use_tqdm=False)[0].outputs[0]
    with torch.inference_mode():
        ref = torch.log_softmax(hf(torch.tensor([ids])).logits[0, -1].double(), -1)
    top = torch.topk(ref, 5)
    entries = out.logprobs[0]
    assert set(top.indices.tolist()) <= set(entries)
    for rank, (tid, value) in enumerate(zip(top.indices.tolist(), top.values.tolist()), start=1):
        assert entries[tid].logprob == pytest.approx(value, abs=1e-4)
        assert entries[tid].rank == rank
    assert out.token_ids[0] == top.indices[0].item()


def test_stop_conditions(llm):
    base = llm.generate(["Count: one, two, three,"], SamplingParams(temperature=0, max_tokens=20), use_tqdm=False)
    text = base[0].outputs[0].text
    assert len(text) > 6
    stop = text[3:6]
    cut = llm.generate(["Count: one, two, three,"], SamplingParams(temperature=0, max_tokens=20, stop=[stop]),
                       use_tqdm=False)[0].outputs[0]
    assert cut.finish_reason == "stop" and cut.stop_reason == stop and cut.text == text[: text.index(stop)]
    first_id = base[0].outputs[0].token_ids[2]
    by_id = llm.generate(["Count: one, two, three,"],
                         SamplingParams(temperature=0, max_tokens=20, stop_token_ids=[first_id]), use_tqdm=False)
    assert by_id[0].outputs[0].stop_reason == first_id and len(by_id[0].outputs[0].token_ids) <= 3
    assert llm.generate(["Hi"], SamplingParams(max_tokens=3, ignore_eos=True),
                        use_tqdm=False)[0].outputs[0].finish_reason == "length"


def test_errors_name_the_problem(llm):
    engine = llm.engine
    too_long = [1] * engine.max_model_len
    with pytest.raises(ValueError, match=rf"{engine.max_model_len}.*{len(too_long)}"):
        llm.generate([{"prompt_token_ids": too_long}], use_tqdm=False)
    with pytest.raises(ValueError) as err:
        LLM("no-such-model-anywhere")
    assert "no-such-model-anywhere" in str(err.value)
    for bad, name in [({"top_p": 0}, "top_p"), ({"temperature": -1}, "temperature"), ({"n": 0}, "n"),
                      ({"max_tokens": 0}, "max_tokens")]:
        with pytest.raises(ValueError, match=name):
            SamplingParams(**bad)
    assert all_blocks_free(engine)


def test_profile_batch_is_the_largest_step_with_decodes_first():
    """The cache-sizing step: ``token_budget`` tokens (capped by what the sequences can hold), at
    most ``max_num_seqs`` sequences, none longer than ``max_model_len``, decodes at the front."""
    import itertools

    from podium.kv_cache import profile_batch

    for budget, seqs, model_len, block in itertools.product((1, 2, 7, 300, 8192), (1, 2, 3, 256), (1, 2, 16, 1024), (1, 16)):
        query_lens, seq_lens = profile_batch(budget, seqs, model_len, block)
        case = (budget, seqs, model_len, block, query_lens, seq_lens)
        assert sum(query_lens) == min(budget, seqs * model_len), case
        assert len(query_lens) <= seqs and all(1 <= q <= n <= model_len for q, n in zip(query_lens, seq_lens)), case
        decodes = sum(n > q for q, n in zip(query_lens, seq_lens))  # the rest: fresh prompt chunks (q == n)
        assert query_lens[:decodes] == [1] * decodes and query_lens[decodes:] == seq_lens[decodes:], case
    query_lens, seq_lens = profile_batch(8192, 256, 1024, 16)
    assert query_lens[:248] == [1] * 248 and seq_lens[:248] == [17] * 248 and query_lens[248:] == [1024] * 7 + [776]


def test_profile_forward_runs_the_mixed_step_on_the_platform_backend(llm, monkeypatch):
    """The sizing forward (run where a platform sizes its cache from free memory) hands the platform's
    backend one mixed step that starts with decodes, and the model runs it."""
    from podium.kv_cache import kv_cache_spec, profile_batch

    engine = llm.engine
    backend = engine.platform.attention_backend()
    monkeypatch.setattr(engine.platform, "attention_backend", lambda: backend)
    seen = []
    prepare = backend.prepare_metadata
    monkeypatch.setattr(backend, "prepare_metadata", lambda meta: seen.append(meta) or prepare(meta))
    engine.shard._profile_forward(kv_cache_spec(engine.source.hf_config, engine.config.block_size,
                                                engine.kv_cache_dtype))
    (meta,) = seen
    want = profile_batch(engine.config.token_budget, engine.config.max_num_seqs, engine.max_model_len,
                         engine.config.block_size)
    assert (list(meta.query_lens_host), list(meta.seq_lens_host)) == (list(want[0]), list(want[1]))
    assert meta.query_lens_host[0] == 1 and not meta.is_pure_decode
