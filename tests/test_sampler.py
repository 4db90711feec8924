"""The sampler against independent references: argmax, float64 filters and penalties written out
per row, log-softmax, and distribution / reproducibility properties."""

from __future__ import annotations

import math
import random
from collections import Counter

import pytest
import torch

from podium.errors import StepFault
from podium.request import Sequence
from podium.sampler import Sampler, apply_penalties, first_argmax, sampling_probs
from podium.sampling_params import SamplingParams


@pytest.fixture(autouse=True)
def one_thread():
    """These tensors are tiny: one intra-op thread spares OpenMP wake-ups on a busy machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def make_seq(seq_id: int, prompt=(1, 2, 3), sample_index: int = 0, **params) -> Sequence:
    return Sequence(seq_id, f"r{seq_id}", sample_index, list(prompt), SamplingParams(max_tokens=None, **params))


def fake_model_logits(seq: Sequence, vocab: int, scale: float = 2.0) -> torch.Tensor:
    """A deterministic 'model': the next-token logits [V] depend only on the sequence's tokens."""
    key = hash(tuple(seq.token_ids)) % (2**31)
    return torch.randn(vocab, generator=torch.Generator().manual_seed(key)) * scale


def run_steps(sampler: Sampler, batches: list[list[Sequence]], vocab: int) -> None:
    """One sample() per entry of ``batches``; every sampled token is appended to its sequence."""
    for seqs in batches:
        logits = torch.stack([fake_model_logits(s, vocab) for s in seqs])
        for seq, token in zip(seqs, sampler.sample(logits, seqs).token_ids):
            seq.append_token(token)


# -- greedy ---------------------------------------------------------------------------------------
def test_greedy_equals_argmax_fast_path_and_mixed_batch():
    vocab = 300
    torch.manual_seed(0)
    logits = torch.randn(6, vocab)
    logits[2, 10] = logits[2, 200] = logits[2].max() + 1.0  # a tie: the lowest id wins, like torch.argmax
    greedy = [make_seq(i, temperature=0.0) for i in range(6)]
    out = Sampler(vocab, "cpu").sample(logits.clone(), greedy)
    assert out.token_ids == logits.argmax(dim=-1).tolist()
    assert out.token_ids[2] == 10
    assert out.logprobs == [None] * 6
    # the same greedy rows inside a batch that also samples, seeds and asks for logprobs
    mixed = [make_seq(10 + i, temperature=0.0, logprobs=2 if i % 2 else None) for i in range(6)]
    others = [make_seq(30, temperature=1.0), make_seq(31, temperature=0.7, seed=5, top_k=3)]
    batch_logits = torch.cat([logits, torch.randn(2, vocab)])
    out = Sampler(vocab, "cpu").sample(batch_logits.clone(), mixed + others)
    assert out.token_ids[:6] == logits.argmax(dim=-1).tolist()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_logits_sample_as_their_float32_upcast(dtype):
    """Models hand over logits in their own dtype: every row, plain greedy (argmax on the half
    values) or not (bias, penalties, seeded draws, logprobs), gets what the float32 upcast gives."""
    vocab = 700
    logits = (torch.randn(8, vocab, generator=torch.Generator().manual_seed(3)) * 4).to(dtype)
    logits[0, [5, 600]] = logits[0].max() + 1  # a tie after rounding: the first index wins

    def batch(offset):
        return [make_seq(offset, temperature=0.0), make_seq(offset + 1, temperature=0.0, logprobs=3),
                make_seq(offset + 2, temperature=0.8, seed=7, top_k=20),
                make_seq(offset + 3, temperature=1.0, seed=9, top_p=0.9, min_p=0.05),
                make_seq(offset + 4, temperature=0.0, repetition_penalty=1.3, presence_penalty=0.5),
                make_seq(offset + 5, temperature=0.0, logit_bias={11: 100.0}),
                make_seq(offset + 6, temperature=0.5, seed=1, frequency_penalty=0.4),
                make_seq(offset + 7, temperature=0.0)]

    plain = [make_seq(100 + i, temperature=0.0) for i in range(8)]
    half, full = Sampler(vocab, "cpu", seed=0), Sampler(vocab, "cpu", seed=0)
    assert half.sample(logits.clone(), plain).token_ids == full.sample(logits.float(), plain).token_ids \
        == logits.float().argmax(dim=-1).tolist()
    got, want = half.sample(logits.clone(), batch(0)), full.sample(logits.float(), batch(0))
    assert got.token_ids == want.token_ids and got.token_ids[5] == 11
    assert got.logprobs == want.logprobs and got.logprobs[1] is not None
    first_seqs = batch(20)
    assert torch.equal(half.sample_device(logits.clone(), first_seqs), full.sample_device(logits.float(), first_seqs))


# -- seeds ----------------------------------------------------------------------------------------
def test_seeded_sampling_is_independent_of_batch_company():
    vocab, steps = 500, 10
    params = dict(temperature=0.9, top_p=0.95, seed=1234)
    alone = make_seq(0, **params)
    run_steps(Sampler(vocab, "cpu", seed=0), [[alone]] * steps, vocab)

    target = make_seq(7, **params)
    rng = random.Random(1)
    company = [make_seq(100 + i, temperature=rng.choice([0.0, 0.5, 1.3]), seed=rng.choice([None, 99, 1234]),
                        top_k=rng.choice([0, 5])) for i in range(6)]
    batches = []
    for step in range(steps):  # the company changes every step; the target moves around
        others = rng.sample(company, k=step % 5 + 1)
        seqs = others + [target]
        rng.shuffle(seqs)
        batches.append(seqs)
    run_steps(Sampler(vocab, "cpu", seed=77), batches, vocab)
    assert target.output_token_ids == alone.output_token_ids


def test_siblings_of_one_seed_differ_but_reproduce():
    vocab, steps = 1000, 8

    def run() -> list[list[int]]:
        siblings = [make_seq(i, sample_index=i, temperature=1.0, seed=42) for i in range(4)]
        run_steps(Sampler(vocab, "cpu"), [siblings] * steps, vocab)
        return [s.output_token_ids for s in siblings]

    first, second = run(), run()
    assert first == second
    assert len({tuple(t) for t in first}) == 4


def test_unseeded_rows_follow_the_engine_seed():
    vocab = 1000
    logits = torch.randn(16, vocab)
    draws = [Sampler(vocab, "cpu", seed=s).sample(logits.clone(), [make_seq(i) for i in range(16)]).token_ids
             for s in (3, 3, 4)]
    assert draws[0] == draws[1] and draws[0] != draws[2]


# -- top-k / top-p / min-p ------------------------------------------------------------------------
def reference_allowed(logits: torch.Tensor, temperature: float, top_k: int, top_p: float, min_p: float,
                      slack: float) -> torch.Tensor:
    """The allowed set of one row [V] -> bool [V], by sorting in float64. ``slack`` > 0 widens every
    threshold (a superset), < 0 narrows it (a subset), so float32 rounding cannot flip the test."""
    z = logits.double() / temperature
    vocab = z.numel()
    values, order = z.sort(descending=True, stable=True)
    keep = torch.ones(vocab, dtype=torch.bool)
    if 0 < top_k < vocab:
        keep = values >= values[top_k - 1] - slack if slack > 0 else values > values[top_k] - slack
    probs = torch.softmax(values.masked_fill(~keep, -math.inf), dim=0)
    if top_p < 1.0:
        before = torch.cumsum(probs, 0) - probs  # mass strictly above each entry
        keep &= before < top_p + slack
    keep[0] = True
    probs = torch.softmax(values.masked_fill(~keep, -math.inf), dim=0)
    if min_p > 0:
        keep &= probs >= min_p * probs[0] * (1 - slack)
    allowed = torch.zeros(vocab, dtype=torch.bool)
    allowed[order[keep]] = True
    return allowed


def random_filter_params(rng: random.Random, vocab: int) -> dict:
    return dict(
        temperature=rng.uniform(0.2, 2.0),
        top_k=rng.choice([0, -1, 1, 2, rng.randint(1, vocab), vocab, vocab + 3]),
        top_p=rng.choice([1.0, rng.uniform(0.05, 1.0), rng.uniform(0.8, 1.0)]),
        min_p=rng.choice([0.0, rng.uniform(0.0, 0.5), rng.uniform(0.0, 0.05)]),
    )


def test_filters_keep_exactly_the_reference_set():
    rng = random.Random(0)
    for trial in range(100):
        vocab, rows = rng.randint(2, 200), rng.randint(1, 6)
        logits = torch.randn(rows, vocab) * rng.choice([0.3, 1.0, 4.0])
        params = [random_filter_params(rng, vocab) for _ in range(rows)]
        probs = sampling_probs(
            logits.clone(),
            torch.tensor([p["temperature"] for p in params]),
            torch.tensor([p["top_k"] for p in params]),
            torch.tensor([p["top_p"] for p in params]),
            torch.tensor([p["min_p"] for p in params]),
        )
        for row, p in enumerate(params):
            kept = probs[row] > 0
            # float32 running sums cannot resolve mass below ~1e-7: such tokens may drop out
            resolvable = torch.softmax(logits[row].double() / p["temperature"], dim=0) > 1e-6
            strict = reference_allowed(logits[row], **p, slack=-1e-5) & resolvable
            loose = reference_allowed(logits[row], **p, slack=1e-5)
            assert bool((strict <= kept).all()), (trial, row, p)
            assert bool((kept <= loose).all()), (trial, row, p)


def test_sampled_tokens_stay_in_the_allowed_set():
    rng = random.Random(1)
    sampler = Sampler(64, "cpu", seed=3)
    for _ in range(25):
        rows = 16
        logits = torch.randn(rows, 64) * 3
        params = [random_filter_params(rng, 64) for _ in range(rows)]
        seqs = [make_seq(i, seed=rng.choice([None, i]), **p) for i, p in enumerate(params)]
        tokens = sampler.sample(logits.clone(), seqs).token_ids
        for row, (token, p) in enumerate(zip(tokens, params)):
            assert reference_allowed(logits[row], **p, slack=1e-5)[token], (row, p)
        for s in seqs:
            sampler.forget(s.seq_id)


def expected_distribution(logits: torch.Tensor, temperature, top_k, top_p, min_p) -> torch.Tensor:
    allowed = reference_allowed(logits, temperature, top_k, top_p, min_p, slack=0.0)
    probs = torch.softmax((logits.double() / temperature).masked_fill(~allowed, -math.inf), dim=0)
    return probs


@pytest.mark.parametrize("mode", ["shared generator", "one seed per row", "one seeded stream over steps"])
def test_sampled_distribution_matches_the_reference(mode):
    base = torch.tensor([2.0, 1.5, 1.0, 0.6, 0.0, -0.5, -1.0, -3.0])
    params = dict(temperature=0.8, top_k=7, top_p=0.97, min_p=0.03)
    expected = expected_distribution(base, **params)
    sampler = Sampler(8, "cpu", seed=11)
    if mode == "one seeded stream over steps":  # 16 samples of one seed, 400 steps each
        draws, seqs = 6400, [make_seq(i, sample_index=i, seed=5, **params) for i in range(16)]
        tokens = []
        for _ in range(draws // 16):
            step = sampler.sample(base.repeat(16, 1), seqs).token_ids
            tokens += step
            for seq, token in zip(seqs, step):
                seq.append_token(token)
    else:
        draws = 12000
        seqs = [make_seq(i, seed=i if mode == "one seed per row" else None, **params) for i in range(draws)]
        tokens = sampler.sample(base.repeat(draws, 1), seqs).token_ids
    counts = Counter(tokens)
    assert all(expected[t] > 0 for t in counts), "a token outside the allowed set was drawn"
    chi2 = 0.0
    for token in range(8):
        p = float(expected[token])
        if p == 0:
            continue
        sigma = math.sqrt(p * (1 - p) / draws)
        assert abs(counts[token] / draws - p) < 5 * sigma + 1e-3, (token, counts[token] / draws, p)
        chi2 += (counts[token] - draws * p) ** 2 / (draws * p)
    df = int((expected > 0).sum()) - 1
    assert chi2 < df + 6 * math.sqrt(2 * df), chi2  # far in the tail of chi-square(df)


def test_platform_top_k_top_p_op_is_used():
    calls = []

    def spy(logits, top_k, top_p):
        calls.append((top_k.tolist(), top_p.tolist()))
        return logits

    sampler = Sampler(10, "cpu", ops={"top_k_top_p": spy})
    sampler.sample(torch.randn(2, 10), [make_seq(0, top_k=3), make_seq(1, top_p=0.5)])
    assert calls == [([3, 0], [1.0, 0.5])]


# -- penalties, logit_bias, min_tokens --------------------------------------------------------------
def reference_penalised(logits: torch.Tensor, seq: Sequence) -> torch.Tensor:
    """One row [V] processed token by token in float64: bias, repetition, frequency, presence."""
    p, z = seq.params, logits.double().clone()
    for token, bias in (p.logit_bias or {}).items():
        z[token] += bias
    for token in set(seq.token_ids):
        z[token] = z[token] / p.repetition_penalty if z[token] > 0 else z[token] * p.repetition_penalty
    for token, count in Counter(seq.output_token_ids).items():
        z[token] -= p.frequency_penalty * count + p.presence_penalty
    return z


def test_apply_penalties_matches_a_per_row_loop():
    torch.manual_seed(0)
    rows, vocab = 5, 40
    logits = torch.randn(rows, vocab) * 3
    counts = torch.randint(0, 4, (rows, vocab)) * (torch.rand(rows, vocab) < 0.3)
    in_prompt = torch.rand(rows, vocab) < 0.2
    rep, freq, pres = torch.rand(rows) * 1.5 + 0.5, torch.rand(rows) * 4 - 2, torch.rand(rows) * 4 - 2
    got = apply_penalties(logits.clone(), counts, in_prompt, rep, freq, pres)
    for r in range(rows):
        for t in range(vocab):
            z = float(logits[r, t])
            if counts[r, t] > 0 or in_prompt[r, t]:
                z = z / float(rep[r]) if z > 0 else z * float(rep[r])
            z -= float(freq[r]) * int(counts[r, t]) + float(pres[r]) * (int(counts[r, t]) > 0)
            assert float(got[r, t]) == pytest.approx(z, abs=1e-5)


def test_penalties_and_bias_over_many_steps_match_the_reference():
    """Greedy sequences with penalties: every step's token is the argmax of the reference-penalised
    logits, while sequences join, leave (forget) and reuse count slots, in changing order."""
    vocab, rng = 30, random.Random(5)
    sampler = Sampler(vocab, "cpu")

    def new_seq(seq_id: int) -> Sequence:
        bias = {rng.randrange(vocab): rng.uniform(-3, 3) for _ in range(rng.randint(0, 3))}
        return make_seq(seq_id, prompt=[rng.randrange(vocab) for _ in range(rng.randint(1, 8))], temperature=0.0,
                        repetition_penalty=rng.choice([1.0, rng.uniform(0.5, 2.0)]),
                        frequency_penalty=rng.uniform(-1, 2), presence_penalty=rng.uniform(-1, 2), logit_bias=bias)

    live = [new_seq(i) for i in range(4)]
    next_id = 4
    for step in range(25):
        rng.shuffle(live)
        logits = torch.stack([fake_model_logits(s, vocab) for s in live])
        references = [reference_penalised(logits[r], s) for r, s in enumerate(live)]
        tokens = sampler.sample(logits.clone(), live).token_ids
        for seq, token, ref in zip(live, tokens, references):
            assert float(ref[token]) >= float(ref.max()) - 1e-4, (step, seq.seq_id)
            seq.append_token(token)
        if step % 4 == 3:  # one leaves, a newcomer may take its count slot
            gone = live.pop()
            sampler.forget(gone.seq_id)
            live.append(new_seq(next_id))
            next_id += 1


def test_logit_bias_forces_and_forbids():
    vocab = 50
    logits = torch.randn(2, vocab)
    top = int(logits[1].argmax())
    seqs = [make_seq(0, temperature=1.0, logit_bias={7: 100.0}), make_seq(1, temperature=0.0, logit_bias={top: -100.0})]
    for _ in range(5):
        tokens = Sampler(vocab, "cpu").sample(logits.clone(), seqs).token_ids
        assert tokens[0] == 7 and tokens[1] != top
    with pytest.raises(StepFault, match="logit_bias") as fault:  # pinned to its request: the engine aborts it alone
        Sampler(vocab, "cpu").sample(logits[:1].clone(), [make_seq(5, logit_bias={vocab: 1.0})])
    assert isinstance(fault.value.__cause__, ValueError)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_min_tokens_masks_eos_and_stop_ids(temperature):
    vocab, eos, stop_id = 20, 0, 1
    row = torch.full((vocab,), -5.0)
    row[eos], row[stop_id], row[2] = 10.0, 9.0, 0.0  # EOS, then the stop id, dominate
    sampler = Sampler(vocab, "cpu", eos_token_ids=[eos])
    seqs = [make_seq(i, temperature=temperature, min_tokens=3, stop_token_ids=[stop_id]) for i in range(8)]
    for step in range(4):
        tokens = sampler.sample(row.repeat(len(seqs), 1), seqs).token_ids
        if step < 3:
            assert all(t not in (eos, stop_id) for t in tokens), step
        elif temperature == 0.0:
            assert tokens == [eos] * len(seqs)
        for s, t in zip(seqs, tokens):
            s.append_token(t)
    # ignore_eos: EOS does not stop the sequence, so min_tokens leaves it alone; the stop id stays masked
    seq = make_seq(99, temperature=0.0, min_tokens=3, stop_token_ids=[stop_id], ignore_eos=True)
    assert sampler.sample(row[None].clone(), [seq]).token_ids == [eos]


# -- logprobs -------------------------------------------------------------------------------------
def check_position_logprobs(entry, raw_row: torch.Tensor, chosen: int, k: int) -> None:
    reference = torch.log_softmax(raw_row.double(), dim=0)
    assert chosen in entry
    assert list(entry)[0] == chosen
    top = reference.topk(k).indices.tolist() if k else []
    assert set(entry) == {chosen, *top}
    for token, lp in entry.items():
        assert lp.logprob == pytest.approx(float(reference[token]), abs=1e-5)
        assert lp.rank == 1 + int((reference > reference[token]).sum())


def test_logprobs_are_raw_log_softmax_with_ranks():
    vocab = 120
    torch.manual_seed(3)
    raw = torch.randn(5, vocab) * 2
    ks = [0, 1, 5, None, 20]
    seqs = [make_seq(0, temperature=0.0, logprobs=0, repetition_penalty=1.5),
            make_seq(1, temperature=0.7, logprobs=1, top_k=10),
            make_seq(2, temperature=1.2, logprobs=5, presence_penalty=1.0, logit_bias={3: 4.0}),
            make_seq(3, temperature=1.0),
            make_seq(4, temperature=0.5, logprobs=20, seed=9, min_p=0.2)]
    out = Sampler(vocab, "cpu").sample(raw.clone(), seqs)
    assert out.logprobs[3] is None
    for row, k in enumerate(ks):
        if k is not None:
            check_position_logprobs(out.logprobs[row], raw[row], out.token_ids[row], k)


def test_prompt_logprobs():
    vocab = 60
    raw = torch.randn(7, vocab)
    targets = [random.Random(0).randrange(vocab) for _ in range(7)]
    entries = Sampler(vocab, "cpu").prompt_logprobs(raw.clone(), targets, 3)
    assert len(entries) == 7
    for row, entry in enumerate(entries):
        check_position_logprobs(entry, raw[row], targets[row], 3)


def test_bad_logits_shape_is_an_error():
    with pytest.raises(ValueError, match="logits"):
        Sampler(10, "cpu").sample(torch.randn(2, 11), [make_seq(0), make_seq(1)])


@pytest.mark.parametrize("vocab", [7, 1000, 1024, 1536, 49152, 50257])
def test_first_argmax_is_argmax_with_ties_and_nan(vocab):
    gen = torch.Generator().manual_seed(vocab)
    logits = torch.randn(9, vocab, generator=gen)
    logits[1, [3 % vocab, vocab - 2]] = 50.0  # a tie: the first index wins
    logits[2, vocab - 1] = 60.0  # the maximum in the ragged tail
    logits[3, [vocab // 2, vocab - 1]] = float("nan")  # NaN counts as the maximum, first one wins
    logits[4, vocab - 1] = float("nan")  # NaN only in the tail
    logits[5] = 1.0  # all equal: index 0
    logits[6, :] = float("-inf")
    logits[7, vocab - 3] = float("inf")
    assert torch.equal(first_argmax(logits), logits.argmax(dim=-1))
    bf16 = logits.bfloat16()  # many ties after rounding
    assert torch.equal(first_argmax(bf16), bf16.argmax(dim=-1))
