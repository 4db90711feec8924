"""Speculative decoding (n-gram): the proposer, the config, and the property that matters: the
output is the target's own, token for token (greedy, seeded) and in distribution (unseeded,
chi-square against the target's exact probabilities from transformers), in mixed batches with
preemption, chunked prefill and prefix caching, with every block free at the end."""

from __future__ import annotations

import json
import random

import pytest
import torch
from engine_fixtures import smollm2_gguf
from model_fixtures import save_tiny_model, single_thread  # noqa: F401 (fixture)

from podium import LLM, SamplingParams
from podium.config import EngineConfig
from podium.engine_flags import add_engine_flags, engine_kwargs
from podium.errors import InvalidParameter
from podium.spec import NgramProposer, SpeculativeConfig, speculative_config

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}


# -- the proposer and the config ----------------------------------------------------------------

def test_ngram_proposes_what_followed_the_latest_match():
    proposer = NgramProposer(SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_max=3, prompt_lookup_min=2))
    assert proposer.propose([1, 2, 3, 4, 5, 9, 2, 3, 7, 8, 2, 3]) == [7, 8, 2]  # latest "2 3" wins
    assert proposer.propose([1, 2, 3, 9, 1, 2, 3]) == [9, 1, 2]  # the 3-gram "1 2 3"
    assert proposer.propose([1, 2, 3, 9, 1, 2, 3], k=1) == [9]
    assert proposer.propose([5, 6, 7, 8]) == []  # nothing repeats
    assert proposer.propose([4, 5, 9, 4]) == []  # a 1-gram is below prompt_lookup_min
    assert proposer.propose([1, 2, 1, 2]) == [1, 2]  # the continuation runs up to the end


def test_config_is_validated_with_the_reason():
    assert speculative_config(json.dumps(NGRAM)) == SpeculativeConfig(**NGRAM)
    assert EngineConfig(speculative_config=NGRAM).speculative_config.num_speculative_tokens == 3
    for bad, words in [({"method": "medusa"}, "method must be one of"),
                       ({"method": "draft_model", "num_speculative_tokens": 2}, "needs 'model'"),
                       ({"method": "eagle3"}, "needs 'model'"),
                       ({"method": "ngram", "model": "x"}, "takes no model"),
                       ({"method": "draft_model", "model": "x", "draft_tensor_parallel_size": 2},
                        "draft_tensor_parallel_size=2"),
                       ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
                       ({"method": "ngram", "prompt_lookup_min": 5, "prompt_lookup_max": 2}, "must not exceed"),
                       ({"method": "ngram", "k": 2}, "unknown key"), ({"num_speculative_tokens": 2}, "needs a method"),
                       ("{not json", "not valid JSON")]:
        with pytest.raises(ValueError, match=words):
            speculative_config(bad)


def test_cli_flag_takes_json():
    import argparse

    parser = argparse.ArgumentParser()
    add_engine_flags(parser)
    args = parser.parse_args(["--speculative-config", json.dumps(NGRAM)])
    assert EngineConfig(**engine_kwargs(args)).speculative_config == SpeculativeConfig(**NGRAM)


# -- the engine on a tiny random model ----------------------------------------------------------

@pytest.fixture(scope="module")
def tiny(tmp_path_factory, single_thread):  # noqa: F811
    folder = tmp_path_factory.mktemp("tiny-llama")
    hf = save_tiny_model("llama", {}, folder, seed=3)
    return folder, hf


def tiny_llm(folder, spec: dict | None, **kwargs) -> LLM:
    settings = dict(device="cpu", dtype="float32", block_size=4, num_kv_blocks=48, max_num_seqs=6,
                    max_num_batched_tokens=24, enable_prefix_caching=True, max_model_len=96)
    return LLM(str(folder), speculative_config=spec, **{**settings, **kwargs})


def repetitive_prompts(count: int, seed: int) -> list[list[int]]:
    """Prompts that repeat a short motif (the n-gram proposer finds them) and random ones (it may not)."""
    rng = random.Random(seed)
    prompts = []
    for i in range(count):
        if i % 3 == 2:
            prompts.append([rng.randrange(96) for _ in range(rng.randint(3, 30))])
        else:
            motif = [rng.randrange(96) for _ in range(rng.randint(2, 5))]
            prompts.append((motif * 10)[:rng.randint(6, 40)])
    return prompts


def assert_idle(llm: LLM) -> None:
    stats = llm.engine.stats()
    assert stats.num_free_blocks == stats.num_total_blocks and stats.num_running == stats.num_waiting == 0


def outputs(llm: LLM, prompts, params) -> list[tuple]:
    """(tokens, logprobs, finish reason, prompt logprobs) of every sample of every request, in order."""
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [(c.token_ids, c.logprobs, c.finish_reason, o.prompt_logprobs) for o in outs for c in o.outputs]


def test_greedy_and_seeded_outputs_equal_plain_decoding_in_a_mixed_batch(tiny):
    """A mixed batch (greedy, seeded sampling with penalties, logprobs, stop ids, max_tokens) in a
    cache small enough to preempt, a budget that chunks prompts, prefix caching on: speculation
    changes no token and no logprob, accepts drafts, and frees every block."""
    folder, _ = tiny
    prompts = repetitive_prompts(14, seed=1)
    rng = random.Random(2)
    params = []
    for i in range(len(prompts)):
        if i % 2:
            params.append(SamplingParams(temperature=0.8, seed=rng.randrange(1000), max_tokens=rng.randint(5, 30),
                                         repetition_penalty=rng.choice([1.0, 1.3]), logprobs=2, ignore_eos=True))
        else:
            params.append(SamplingParams(temperature=0, max_tokens=rng.randint(1, 30), logprobs=1,
                                         stop_token_ids=[rng.randrange(96)], ignore_eos=True))
    params[3] = SamplingParams(temperature=0.7, seed=5, n=2, max_tokens=20, logprobs=0, ignore_eos=True)
    params[4] = SamplingParams(temperature=0, max_tokens=12, prompt_logprobs=1, logprobs=0, ignore_eos=True)
    plain = tiny_llm(folder, None)
    spec = tiny_llm(folder, NGRAM)
    expected, got = outputs(plain, prompts, params), outputs(spec, prompts, params)
    assert len(got) == len(expected) == len(prompts) + 1
    for want, have in zip(expected, got):
        assert have[0] == want[0] and have[2] == want[2]
        assert len(have[1]) == len(have[0])
        assert (have[3] is None) == (want[3] is None)
        for a, b in zip(have[1] + (have[3] or [])[1:], want[1] + (want[3] or [])[1:]):
            assert a.keys() == b.keys()
            assert all(abs(a[t].logprob - b[t].logprob) < 1e-4 and a[t].rank == b[t].rank for t in a)
    stats = spec.engine.stats()
    assert stats.num_preemptions > 0, "the cache should be small enough to preempt"
    spec_stats = stats.spec_decoding
    assert spec_stats.num_draft_tokens > 0 and 0 < spec_stats.num_accepted_tokens < spec_stats.num_draft_tokens
    assert len(spec_stats.accepted_per_position) == 3
    assert spec_stats.mean_accepted_length > 1.0
    assert_idle(spec)


@pytest.fixture(scope="module")
def tiny_vocab(tmp_path_factory, single_thread):  # noqa: F811
    folder = tmp_path_factory.mktemp("tiny-vocab")
    hf = save_tiny_model("llama", {"vocab_size": 6}, folder, seed=5)
    return folder, hf


def chi_square_p(counts: dict, expected: dict, samples: int) -> tuple[float, float, int]:
    """(statistic, p-value, degrees of freedom) of observed ``counts`` against probabilities
    ``expected`` (cells expected fewer than 5 times pooled into one)."""
    assert all(expected.get(c, 0) > 0 for c in counts), "an outcome of probability 0 was produced"
    cells = sorted((c for c in expected if expected[c] > 0), key=expected.get, reverse=True)
    observed = torch.tensor([counts.get(c, 0) for c in cells], dtype=torch.float64)
    mean = torch.tensor([expected[c] * samples for c in cells], dtype=torch.float64)
    big = mean >= 5
    if mean[~big].sum() > 0:
        observed = torch.cat([observed[big], observed[~big].sum().reshape(1)])
        mean = torch.cat([mean[big], mean[~big].sum().reshape(1)])
    else:
        observed, mean = observed[big], mean[big]
    statistic = float(((observed - mean) ** 2 / mean).sum())
    dof = len(mean) - 1
    p_value = float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64),
                                            torch.tensor(statistic / 2, dtype=torch.float64)))
    return statistic, p_value, dof


def test_sampled_output_follows_the_target_distribution(tiny_vocab):
    """3-token continuations on a 6-token vocabulary, 4000 unseeded samples, a draft verified at
    every decode (every token occurs in the prompt, so the 1-gram lookup always proposes): a
    chi-square test against the exact joint probabilities from transformers."""
    folder, hf = tiny_vocab
    prompt = [0, 1, 2, 3, 4, 5, 3, 1, 4]
    llm = tiny_llm(folder, NGRAM, max_num_seqs=256, num_kv_blocks=2048, max_num_batched_tokens=2048, seed=11)
    samples, temperature = 4000, 1.3
    outs = llm.generate([{"prompt_token_ids": prompt}] * samples,
                        SamplingParams(temperature=temperature, max_tokens=3, ignore_eos=True), use_tqdm=False)
    spec = llm.engine.stats().spec_decoding
    assert spec.num_draft_tokens >= samples and 0 < spec.num_accepted_tokens < spec.num_draft_tokens
    counts: dict[tuple, int] = {}
    for o in outs:
        key = tuple(o.outputs[0].token_ids)
        counts[key] = counts.get(key, 0) + 1
    expected = target_sequences(hf, prompt, temperature, length=3)
    statistic, p_value, dof = chi_square_p(counts, expected, samples)
    assert p_value > 1e-3, f"chi-square {statistic:.1f} on {dof} degrees of freedom (p = {p_value:.2e})"
    assert_idle(llm)


def target_sequences(hf, prompt: list[int], temperature: float, length: int) -> dict[tuple, float]:
    """P(t1 .. t_length | prompt) under the target at ``temperature``, in float64, for every sequence."""
    with torch.no_grad():
        def dist(tokens):
            return torch.softmax(hf(torch.tensor([tokens])).logits[0, -1].double() / temperature, dim=-1)

        probs = {(): 1.0}
        for _ in range(length):
            probs = {seq + (t,): p * float(q) for seq, p in probs.items()
                     for t, q in enumerate(dist(prompt + list(seq)))}
    return probs


def test_verification_rule_keeps_each_rows_distribution():
    """The rejection rule alone on a real Sampler: rows of fixed logits (temperature 0.9, top-k 3)
    and drafts of high and low probability, 6000 sequences in one call: the produced tokens follow
    the rows' distributions (accepting draft j takes row j + 1 next)."""
    from podium.request import Sequence
    from podium.sampler import Sampler
    from podium.spec.verify import verify

    torch.manual_seed(0)
    vocab, samples = 5, 6000
    rows = torch.randn(3, vocab) * 1.5  # [d + 1, V]
    params = SamplingParams(temperature=0.9, top_k=3, max_tokens=10)
    drafts = [int(rows[0].argmax()), int(rows[1].topk(2).indices[1])]  # a likely draft, then a less likely one
    seqs = [Sequence(i, str(i), 0, [0], params) for i in range(samples)]
    sampler = Sampler(vocab, "cpu", seed=1)

    def book(batch, sampled, position):
        for seq, token in zip(batch, sampled.token_ids):
            seq.append_token(token)

    accepted = verify(sampler, rows.repeat(samples, 1), seqs, [drafts] * samples, book)
    kept = torch.softmax(rows / 0.9, dim=-1)
    kept = kept.masked_fill(rows < rows.topk(3, dim=-1).values[:, -1:], 0)
    kept = (kept / kept.sum(-1, keepdim=True)).double()
    expected: dict[tuple, float] = {}
    for a in range(vocab):  # outcome: tokens until the first that differs from its draft, or the bonus
        if a != drafts[0]:
            expected[(a,)] = float(kept[0, a])
            continue
        for b in range(vocab):
            if b != drafts[1]:
                expected[(a, b)] = float(kept[0, a] * kept[1, b])
                continue
            for c in range(vocab):
                expected[(a, b, c)] = float(kept[0, a] * kept[1, b] * kept[2, c])
    counts: dict[tuple, int] = {}
    for seq, n in zip(seqs, accepted):
        key = tuple(seq.output_token_ids)
        assert len(key) == n + 1
        counts[key] = counts.get(key, 0) + 1
    assert 0.2 < sum(accepted) / (2 * samples) < 0.8  # both the accept and the reject paths are taken
    statistic, p_value, dof = chi_square_p(counts, expected, samples)
    assert p_value > 1e-3, f"chi-square {statistic:.1f} on {dof} degrees of freedom (p = {p_value:.2e})"


def test_budget_and_length_limits_trim_drafts(tiny):
    """A budget of 2 tokens verifies at most one draft per step, and drafts never run past
    max_model_len (max_tokens None: each runs until its context is full); output and freed blocks
    are as without speculation."""
    folder, _ = tiny
    prompts = [[3, 4, 5] * 6, [9, 9, 9, 9]]
    params = SamplingParams(temperature=0, max_tokens=None, ignore_eos=True)
    expected = outputs(tiny_llm(folder, None, max_num_batched_tokens=2, max_model_len=40), prompts, params)
    llm = tiny_llm(folder, NGRAM, max_num_batched_tokens=2, max_model_len=40)
    assert outputs(llm, prompts, params) == expected
    assert llm.engine.stats().spec_decoding.proposed_per_position[1:] in ([], [0, 0])
    assert_idle(llm)


# -- the real model: stop strings and text ------------------------------------------------------

@pytest.fixture(scope="module")
def smollm2_spec() -> LLM:
    smollm2_gguf()
    return LLM("smollm2-135m-instruct", dtype="float32", device="cpu", speculative_config=NGRAM)


def test_smollm2_repeat_task_with_stop_string(smollm2_spec):
    text = "The quick brown fox jumps over the lazy dog. The quick brown fox jumps over the lazy dog."
    prompts = [f"Repeat this text exactly: {text}\nRepeated: The quick", "List three colors:"]
    params = [SamplingParams(temperature=0, max_tokens=40, stop=["lazy dog. The"]),
              SamplingParams(temperature=0, max_tokens=16)]
    runs = []
    for llm in (LLM("smollm2-135m-instruct", dtype="float32", device="cpu"), smollm2_spec):
        outs = llm.generate(prompts, params, use_tqdm=False)
        runs.append([(o.outputs[0].text, o.outputs[0].token_ids, o.outputs[0].finish_reason) for o in outs])
        assert_idle(llm)
    assert runs[0] == runs[1]
    assert runs[1][0][2] == "stop"
    assert llm.engine.stats().spec_decoding.num_accepted_tokens > 0


def test_server_metrics_export_spec_counters():
    from types import SimpleNamespace

    from podium.spec import SpecDecodingStats
    from podium_server.metrics import EngineStatsCollector

    spec = SpecDecodingStats()
    spec.record(3, 2)
    spec.record(2, 0)
    stats = SimpleNamespace(num_running=0, num_waiting=0, kv_cache_usage=0.0, num_free_blocks=1, num_total_blocks=1,
                            prefix_cache_queries=0, prefix_cache_hits=0, num_preemptions=0, spec_decoding=spec)
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for family in EngineStatsCollector(lambda: stats, "m").collect() for s in family.samples}
    assert samples[("podium:spec_decode_num_draft_tokens_total", (("model_name", "m"),))] == 5
    assert samples[("podium:spec_decode_num_accepted_tokens_total", (("model_name", "m"),))] == 2
    assert samples[("podium:spec_decode_num_accepted_tokens_per_pos_total", (("model_name", "m"), ("position", "1")))] == 1
    assert samples[("podium:spec_decode_num_draft_tokens_per_pos_total", (("model_name", "m"), ("position", "2")))] == 1
    assert samples[("podium:spec_decode_acceptance_rate_per_pos", (("model_name", "m"), ("position", "0")))] == 0.5
    assert samples[("podium:spec_decode_acceptance_rate_per_pos", (("model_name", "m"), ("position", "1")))] == 0.5
    assert samples[("podium:spec_decode_acceptance_rate", (("model_name", "m"),))] == pytest.approx(0.4)
    assert samples[("podium:spec_decode_mean_accepted_length", (("model_name", "m"),))] == pytest.approx(2.0)


def test_delta_reports_carry_every_accepted_token_once(tiny):
    """A step that accepts drafts reports the request once, its delta holding all the step's tokens."""
    folder, _ = tiny
    prompt = [5, 6, 7, 8] * 5
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    plain = outputs(tiny_llm(folder, None), [prompt], params)[0][0]
    engine = tiny_llm(folder, NGRAM).engine
    engine.add_request("r", prompt, params, output_kind="delta")
    deltas = []
    while engine.has_unfinished_requests():
        reports = engine.step()
        assert len(reports) <= 1
        deltas += [r.outputs[0].token_ids for r in reports]
    assert sum(deltas, []) == plain
    assert max(map(len, deltas)) > 1  # some step accepted drafts


def test_scheduler_fits_drafts_and_gives_back_rejected_blocks():
    """Exact blocks: drafts take new blocks only while one stays free for each running sequence
    behind; after verification the blocks past the accepted tokens go back to the free pool."""
    from podium.block_manager import BlockManager
    from podium.request import Sequence
    from podium.scheduler import Scheduler

    bm = BlockManager(6, block_size=4, enable_prefix_caching=False)
    sched = Scheduler(bm, max_num_seqs=4, token_budget=64, max_model_len=64)
    params = SamplingParams(max_tokens=20)
    old, new = Sequence(0, "a", 0, [1, 2, 3, 4], params), Sequence(1, "b", 0, [5, 6, 7], params)
    for seq in (old, new):
        sched.add(seq)
    sched.advance(sched.schedule())  # both prompts computed: old holds block 0, new block 1
    assert (old.block_table, new.block_table) == ([0], [1])
    for seq, token in ((old, 9), (new, 8)):
        seq.append_token(token)
    old.draft_token_ids = [10, 11, 12, 13, 14, 15, 16, 17, 18]  # 9 drafts: positions 5..13, blocks 1..3 of old

    plan = sched.schedule()
    first = plan.scheduled[0]
    assert first.seq is old and first.drafts == old.draft_token_ids and first.num_new_tokens == 10
    assert old.block_table == [0, 2, 3, 4] and new.block_table == [1]  # block 5 stays free for `new`
    first.num_accepted = 1  # the engine accepted 10 and sampled 29 in place of 11
    old.token_ids += [10, 29]
    new.append_token(31)
    sched.advance(plan)
    assert old.num_computed_tokens == 6 and old.block_table == [0, 2]  # 7 tokens: blocks 3, 4 given back
    assert bm.free_block_ids() == [5, 4, 3]

    assert bm.allocate(new, 12)  # takes 5 and 4: one free block left, and `new` runs behind `old`
    old.draft_token_ids = [40, 41, 42, 43, 44]
    plan = sched.schedule()
    assert plan.scheduled[0].drafts == [40]  # only the room left in old's last block (position 7)
    assert old.block_table == [0, 2] and bm.free_block_ids() == [3]


def test_server_serves_with_speculation_and_reports_it_at_metrics(smollm2_spec):
    """``podium serve --speculative-config``'s app on SmolLM2: a completion equals the offline
    engine's greedy text, and /metrics carries the draft and accepted counts."""
    import threading
    import time

    import httpx
    import uvicorn

    from podium_server.app import create_app
    from podium_server.settings import ServerSettings

    llm = smollm2_spec
    prompt = "one two three four five, one two three four five, one two three four five, one two"
    want = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)[0].outputs[0].text
    server = uvicorn.Server(uvicorn.Config(create_app(ServerSettings(), llm.engine), host="127.0.0.1", port=0,
                                           log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 60
        while not server.started and time.monotonic() < deadline:
            time.sleep(0.05)
        port = server.servers[0].sockets[0].getsockname()[1]
        base = f"http://127.0.0.1:{port}"
        body = {"model": llm.engine.model_name, "prompt": prompt, "max_tokens": 12, "temperature": 0}
        answer = httpx.post(f"{base}/v1/completions", json=body, timeout=120).json()
        assert answer["choices"][0]["text"] == want
        metrics = httpx.get(f"{base}/metrics", timeout=30).text
        drafted = [line for line in metrics.splitlines() if line.startswith("podium:spec_decode_num_draft_tokens_total")]
        assert drafted and float(drafted[0].split()[-1]) > 0
        assert "podium:spec_decode_acceptance_rate" in metrics
    finally:
        server.should_exit = True
        thread.join(timeout=60)


def test_a_predicted_output_is_drafted_from(tiny):
    """``SamplingParams.prediction`` (token ids or text) joins the n-gram lookup: with the plain run's
    own output as the prediction of a prompt that never repeats, most of the answer is drafted from it
    and accepted; the output is the same either way."""
    folder, _ = tiny
    prompt = random.Random(9).sample(range(96), 20)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    plain = outputs(tiny_llm(folder, None), [prompt], params)[0][0]
    llm = tiny_llm(folder, NGRAM)
    assert outputs(llm, [prompt], params)[0][0] == plain
    before = llm.engine.stats().spec_decoding.copy()
    predicted = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, prediction=list(plain))
    assert outputs(llm, [prompt], predicted)[0][0] == plain
    after = llm.engine.stats().spec_decoding
    accepted = after.num_accepted_tokens - before.num_accepted_tokens
    rate = accepted / (after.num_draft_tokens - before.num_draft_tokens)
    # k = 3: at most 3 of every 4 tokens come from drafts; without the prediction, lookup found half as many
    assert accepted >= 0.6 * len(plain) and accepted >= before.num_accepted_tokens + 6 and rate > 0.85, \
        (accepted, rate, before)
    assert_idle(llm)
    with pytest.raises(InvalidParameter, match="prediction"):  # text needs a tokenizer (this model has none)
        llm.generate([{"prompt_token_ids": prompt}], SamplingParams(prediction="some text"), use_tqdm=False)
