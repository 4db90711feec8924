"""Speculative decoding with drafters on the device: a draft model, EAGLE-1 and EAGLE-3 heads.

The property that matters: the output is the target's own, token for token and logprob for logprob
(greedy and seeded sampling, in mixed batches with chunked prefill, prefix caching and preemption),
and in distribution (chi-square); every block is free at the end. Beyond that: the target as its own
draft accepts every draft; the heads draft exactly what a float64 reference of the EAGLE layouts
drafts from transformers' hidden states; bad configurations are refused with the reason.
"""

from __future__ import annotations

import random

import pytest
from eagle_fixtures import reference_drafts, save_eagle_head
from engine_fixtures import smollm2_gguf
from model_fixtures import save_tiny_model, single_thread  # noqa: F401 (fixture)
from test_spec_decode import NGRAM, assert_idle, chi_square_p, outputs, target_sequences, tiny_llm

from podium import LLM, SamplingParams


@pytest.fixture(scope="module")
def models(tmp_path_factory, single_thread):  # noqa: F811
    """A tiny target, another random model of its shape (a poor draft), and random EAGLE heads."""
    root = tmp_path_factory.mktemp("spec-models")
    target = save_tiny_model("llama", {}, root / "target", seed=3)
    save_tiny_model("llama", {}, root / "other", seed=4)
    heads = {"eagle": save_eagle_head(root / "eagle", target.config, eagle3=False, seed=7),
             "eagle3": save_eagle_head(root / "eagle3", target.config, eagle3=True, seed=8, draft_vocab=48,
                                       aux_layers=(0, 2, 1))}
    return root, target, heads


def spec_config(root, method: str, draft: str = "target", k: int = 3) -> dict:
    model = str(root / (draft if method == "draft_model" else method))
    return {"method": method, "model": model, "num_speculative_tokens": k}


PROPOSERS = [("draft_model", "target"), ("draft_model", "other"), ("eagle", None), ("eagle3", None)]
IDS = ["self-draft", "other-draft", "eagle", "eagle3"]


def mixed_params(count: int, seed: int) -> list[SamplingParams]:
    rng = random.Random(seed)
    params = []
    for i in range(count):
        if i % 2:
            params.append(SamplingParams(temperature=0.8, seed=rng.randrange(1000), max_tokens=rng.randint(5, 25),
                                         repetition_penalty=rng.choice([1.0, 1.3]), logprobs=2, ignore_eos=True))
        else:
            params.append(SamplingParams(temperature=0, max_tokens=rng.randint(1, 25), logprobs=1,
                                         stop_token_ids=[rng.randrange(96)], ignore_eos=True))
    params[3] = SamplingParams(temperature=0.7, seed=5, n=2, max_tokens=20, logprobs=0, ignore_eos=True)
    params[4] = SamplingParams(temperature=0, max_tokens=12, prompt_logprobs=1, logprobs=0, ignore_eos=True)
    return params


def random_prompts(count: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(96) for _ in range(rng.randint(3, 30))] for _ in range(count)]


def assert_same_outputs(got: list[tuple], expected: list[tuple]) -> None:
    assert len(got) == len(expected)
    for have, want in zip(got, expected):
        assert have[0] == want[0] and have[2] == want[2]
        assert (have[3] is None) == (want[3] is None)
        for a, b in zip(have[1] + (have[3] or [])[1:], want[1] + (want[3] or [])[1:]):
            assert a.keys() == b.keys()
            assert all(abs(a[t].logprob - b[t].logprob) < 1e-4 and a[t].rank == b[t].rank for t in a)


@pytest.mark.parametrize("method,draft", PROPOSERS, ids=IDS)
def test_outputs_equal_plain_decoding_in_a_mixed_batch_with_preemption(models, method, draft):
    """Greedy, seeded sampling with penalties, logprobs, stop ids, n=2 and prompt logprobs in a cache
    small enough to preempt, prompts chunked, prefix caching on: drafting changes no token and no
    logprob, and frees every block."""
    root, _, _ = models
    prompts, params = random_prompts(12, seed=1), mixed_params(12, seed=2)
    expected = outputs(tiny_llm(root / "target", None, num_kv_blocks=30), prompts, params)
    llm = tiny_llm(root / "target", spec_config(root, method, draft), num_kv_blocks=30)
    assert_same_outputs(outputs(llm, prompts, params), expected)
    stats = llm.engine.stats()
    assert stats.num_preemptions > 0, "the cache should be small enough to preempt"
    spec = stats.spec_decoding
    assert spec.num_draft_tokens > 0 and len(spec.proposed_per_position) == 3
    assert_idle(llm)


@pytest.mark.parametrize("caching", [True, False], ids=["prefix-cache", "no-cache"])
def test_the_target_as_its_own_draft_accepts_every_draft(models, caching):
    """All-greedy requests with preemption (recomputed sequences hit their own cached blocks): every
    proposed draft is accepted, so the draft's cache always held what the target's does."""
    root, _, _ = models
    prompts = random_prompts(10, seed=3) + [random_prompts(1, seed=4)[0] * 2] * 2  # shared prefixes
    params = SamplingParams(temperature=0, max_tokens=25, ignore_eos=True)
    expected = outputs(tiny_llm(root / "target", None, num_kv_blocks=26), prompts, params)
    llm = tiny_llm(root / "target", spec_config(root, "draft_model"), num_kv_blocks=26,
                   enable_prefix_caching=caching)
    assert outputs(llm, prompts, params) == expected
    stats = llm.engine.stats()
    assert stats.num_preemptions > 0
    spec = stats.spec_decoding
    assert spec.num_draft_tokens > 100 and spec.num_accepted_tokens == spec.num_draft_tokens
    assert spec.acceptance_rate_per_position == [1.0, 1.0, 1.0] and spec.mean_accepted_length > 3.0
    assert_idle(llm)


def test_a_poor_draft_is_rejected_yet_changes_nothing(models):
    root, _, _ = models
    prompts, params = random_prompts(6, seed=5), SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    llm = tiny_llm(root / "target", spec_config(root, "draft_model", "other"))
    assert outputs(llm, prompts, params) == outputs(tiny_llm(root / "target", None), prompts, params)
    assert llm.engine.stats().spec_decoding.acceptance_rate < 0.2


@pytest.mark.parametrize("method", ["eagle", "eagle3"])
def test_heads_draft_what_the_reference_drafts(models, method):
    """Every draft a head proposed in a batch of three chunked prompts (k = 3, after prefill, after
    verifications that accepted and rejected) equals the float64 reference's drafts for the tokens
    the sequence held then: the layout, the target's hidden states and the head's cache are right."""
    root, target, heads = models
    llm = tiny_llm(root / "target", spec_config(root, method), max_num_batched_tokens=16)
    drafter, seen = llm.engine.speculator.drafter, []
    draft = drafter.draft

    def spy(output):
        draft(output)
        seen.extend((list(s.seq.token_ids), list(s.drafts)) for s in output.scheduled if s.drafts)

    drafter.draft = spy
    prompts = random_prompts(3, seed=6)
    outputs(llm, prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    assert len(seen) >= 15
    aux = (0, 2, 1) if method == "eagle3" else None
    for tokens, drafts in seen:
        assert drafts == reference_drafts(target, heads[method], method == "eagle3", tokens, len(drafts), aux)


# -- the distribution: chi-square against the target's exact probabilities ----------------------

@pytest.fixture(scope="module")
def tiny_vocab_models(tmp_path_factory, single_thread):  # noqa: F811
    root = tmp_path_factory.mktemp("spec-vocab")
    target = save_tiny_model("llama", {"vocab_size": 6}, root / "target", seed=5)
    save_tiny_model("llama", {"vocab_size": 6}, root / "other", seed=6)
    save_eagle_head(root / "eagle3", target.config, eagle3=True, seed=9, aux_layers=(0, 1, 2))
    return root, target


@pytest.mark.parametrize("method,draft", [("draft_model", "other"), ("eagle3", None)], ids=["draft-model", "eagle3"])
def test_sampled_output_follows_the_target_distribution(tiny_vocab_models, method, draft):
    """3-token continuations on a 6-token vocabulary, 3000 unseeded samples with drafts verified at
    every decode: a chi-square test against the exact joint probabilities from transformers."""
    root, hf = tiny_vocab_models
    prompt = [0, 1, 2, 3, 4, 5, 3, 1, 4]
    llm = tiny_llm(root / "target", spec_config(root, method, draft or "target", k=2), max_num_seqs=256,
                   num_kv_blocks=2048, max_num_batched_tokens=2048, seed=11)
    samples, temperature = 3000, 1.3
    outs = llm.generate([{"prompt_token_ids": prompt}] * samples,
                        SamplingParams(temperature=temperature, max_tokens=3, ignore_eos=True), use_tqdm=False)
    spec = llm.engine.stats().spec_decoding
    assert spec.num_draft_tokens >= samples and 0 < spec.num_accepted_tokens < spec.num_draft_tokens
    counts: dict[tuple, int] = {}
    for o in outs:
        key = tuple(o.outputs[0].token_ids)
        counts[key] = counts.get(key, 0) + 1
    statistic, p_value, dof = chi_square_p(counts, target_sequences(hf, prompt, temperature, length=3), samples)
    assert p_value > 1e-3, f"chi-square {statistic:.1f} on {dof} degrees of freedom (p = {p_value:.2e})"
    assert_idle(llm)


# -- refusals -----------------------------------------------------------------------------------

def test_bad_drafts_are_refused_with_the_reason(models, tmp_path):
    root, target, _ = models
    save_tiny_model("llama", {"vocab_size": 64}, tmp_path / "narrow", seed=1)
    bad = [({"method": "draft_model", "model": str(tmp_path / "narrow")}, {}, "share the target's vocabulary"),
           ({"method": "draft_model", "model": str(tmp_path / "missing")}, {}, "missing"),
           ({"method": "eagle3", "model": str(root / "eagle")}, {}, "an EAGLE-1 head is method 'eagle'"),
           ({"method": "eagle", "model": str(root / "eagle3")}, {}, "an EAGLE-3 head is method 'eagle3'"),
           ({"method": "eagle", "model": str(root / "target")}, {}, "no fc.weight"),
           ({"method": "draft_model", "model": str(root / "other")}, {"tensor_parallel_size": 2},
            "tensor_parallel_size=2")]
    for spec, extra, words in bad:
        with pytest.raises(ValueError, match=words):
            tiny_llm(root / "target", spec, **extra)


# -- SmolLM2 ------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def smollm2_heads(tmp_path_factory):
    from podium.loader import resolve_model

    smollm2_gguf()
    config = resolve_model("smollm2-135m-instruct").hf_config
    root = tmp_path_factory.mktemp("smollm2-heads")
    save_eagle_head(root / "eagle", config, eagle3=False, seed=1)
    save_eagle_head(root / "eagle3", config, eagle3=True, seed=2, draft_vocab=2048)
    return root


SMOL = dict(dtype="float32", device="cpu", block_size=16, num_kv_blocks=6, max_num_seqs=4, max_model_len=96,
            max_num_batched_tokens=64)


def smollm2_runs(llm: LLM) -> list[tuple]:
    text = "The quick brown fox jumps over the lazy dog. The quick brown fox jumps over the lazy dog."
    prompts = [f"Repeat this text exactly: {text}\nRepeated: The quick", "List three colors:",
               "Count from one to ten: one, two,", "Write a short poem about the sea."]
    params = [SamplingParams(temperature=0, max_tokens=40, stop=["lazy dog. The"]),
              SamplingParams(temperature=0, max_tokens=24, logprobs=1),
              SamplingParams(temperature=0.8, seed=3, max_tokens=30),
              SamplingParams(temperature=0, max_tokens=40, n=2, ignore_eos=True)]
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [(c.text, c.token_ids, c.finish_reason) for o in outs for c in o.outputs]


@pytest.fixture(scope="module")
def smollm2_expected():
    smollm2_gguf()
    llm = LLM("smollm2-135m-instruct", **SMOL)
    runs = smollm2_runs(llm)
    assert llm.engine.stats().num_preemptions > 0, "the cache should be small enough to preempt"
    return runs


@pytest.mark.parametrize("method", ["draft_model", "eagle", "eagle3"])
def test_smollm2_outputs_equal_plain_decoding(smollm2_expected, smollm2_heads, method):
    """SmolLM2 (as its own draft, or random EAGLE heads of its shape) on four requests in a cache
    that preempts: the same text, tokens and finish reasons; the self-draft accepts every greedy draft."""
    model = "smollm2-135m-instruct" if method == "draft_model" else str(smollm2_heads / method)
    llm = LLM("smollm2-135m-instruct", speculative_config={"method": method, "model": model,
                                                           "num_speculative_tokens": 3}, **SMOL)
    assert smollm2_runs(llm) == smollm2_expected
    assert smollm2_expected[0][2] == "stop"
    spec = llm.engine.stats().spec_decoding
    assert spec.num_draft_tokens > 0
    if method == "draft_model":  # the sampled request rejects some of the greedy drafts
        assert spec.acceptance_rate > 0.8
    assert_idle(llm)


def test_speculation_runs_through_captured_graphs(models, monkeypatch):
    """On a platform that captures graphs (replayed by re-running the captured function over its
    static buffers): verify steps replay their own graphs (rows padded to k + 1 tokens), the target's
    kept hidden states come out of its graphs, the heads' and the draft's one-token steps replay
    graphs, and the output is still the plain one."""
    from engine_fixtures import run_engines_on
    from test_runner_graph_path import GraphCpuPlatform

    root, _, _ = models
    prompts, params = random_prompts(8, seed=7), SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    expected = outputs(tiny_llm(root / "target", None, enforce_eager=True), prompts, params)
    run_engines_on(monkeypatch, GraphCpuPlatform())
    for method, draft in [("ngram", None), *PROPOSERS]:
        spec = NGRAM if method == "ngram" else spec_config(root, method, draft or "target")
        llm = tiny_llm(root / "target", spec, device=GraphCpuPlatform.name)
        companion = llm.engine.shard.companion
        runners = [llm.engine.runner] + ([companion.runner] if companion is not None else [])
        assert all(r.graphs for r in runners) and llm.engine.runner.verify_graphs.captured
        replayed = {"verify": 0, "decode": 0, "draft": 0}
        for i, runner in enumerate(runners):
            execute = runner.execute

            def counted(plan, *args, _i=i, _execute=execute, _replayed=replayed):
                step = _execute(plan, *args)
                kind = "draft" if _i else "verify" if plan.sample_drafts else "decode"
                _replayed[kind] += step.used_graph
                return step

            monkeypatch.setattr(runner, "execute", counted)
        assert outputs(llm, prompts, params) == expected, method
        # every proposer's verify steps replay; the heads' and the draft's one-token steps too; the
        # target's pure-decode steps (a sequence's last token: no drafts) replay with the hidden
        # states a head reads
        assert replayed["verify"] > 0 and (replayed["draft"] > 0 or method == "ngram"), (method, replayed)
        assert replayed["decode"] > 0 or method in ("ngram", "draft_model"), (method, replayed)
        assert_idle(llm)
