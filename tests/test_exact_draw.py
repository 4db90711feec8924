"""The batch-invariant mode's random draw (podium.exact_draw) against a Python-integer inverse CDF, and
the sampler in the mode: seeded rows reproduce alone and among others, and draw what the default
mode's float CDF draws but where a float sum lands within rounding of the target."""

from __future__ import annotations

import random

import torch
from test_sampler import make_seq, run_steps

from podium.exact_draw import UNIT_BITS, exact_inverse_cdf
from podium.sampler import Sampler


def python_draw(probs: list[float], u: float) -> int:
    """First token whose running sum of whole 2^-40 units exceeds floor(u * total), in Python ints."""
    units = [int(p * 2**UNIT_BITS) for p in probs]  # p is a float32 value: the product is exact
    total = sum(units)
    target = min(int(u * total), total - 1)  # u * total: one rounding of a float64 product, then floor
    running = 0
    for token, unit in enumerate(units):
        running += unit
        if running > target:
            return token
    return len(units) - 1


def test_boundaries_of_dyadic_probabilities():
    """Probabilities exact in units: u at each cumulative edge picks the next token with mass, never
    a zero-probability one; u just below an edge picks the token before it."""
    probs = torch.tensor([[0.25, 0.0, 0.5, 0.125, 0.125]])

    def below(x: float) -> float:  # the float32 just under x
        return float(torch.nextafter(torch.tensor(x), torch.tensor(0.0)))

    cases = {0.0: 0, below(0.25): 0, 0.25: 2, below(0.75): 2, 0.75: 3, 0.875: 4, below(1.0): 4}
    for u, want in cases.items():
        assert exact_inverse_cdf(probs, torch.tensor([[u]])).item() == want == python_draw(probs[0].tolist(), u), u


def test_random_rows_equal_the_python_draw():
    seed = random.randrange(1 << 30)
    gen = torch.Generator().manual_seed(seed)
    probs = torch.softmax(torch.randn(64, 300, generator=gen) * 4, dim=-1)
    probs[::5] = probs[::5].masked_fill(probs[::5] < 0.01, 0.0)  # unnormalised rows (as min-p leaves them)
    uniform = torch.rand(64, 1, generator=gen)
    got = exact_inverse_cdf(probs, uniform).tolist()
    assert got == [python_draw(p, u) for p, u in zip(probs.tolist(), uniform[:, 0].tolist())], seed
    assert all(probs[i, t] > 0 for i, t in enumerate(got))


def test_the_mode_reproduces_seeds_among_others_and_draws_like_the_default():
    vocab, steps = 500, 10
    params = dict(temperature=0.9, top_p=0.95, seed=1234)
    alone = make_seq(0, **params)
    run_steps(Sampler(vocab, "cpu", batch_invariant=True), [[alone]] * steps, vocab)
    target, rng = make_seq(7, **params), random.Random(1)
    company = [make_seq(100 + i, temperature=rng.choice([0.0, 1.3]), seed=rng.choice([None, 99])) for i in range(6)]
    batches = [rng.sample(company, k=step % 5 + 1) + [target] for step in range(steps)]
    run_steps(Sampler(vocab, "cpu", seed=77, batch_invariant=True), batches, vocab)
    assert target.output_token_ids == alone.output_token_ids
    logits = torch.randn(200, vocab, generator=torch.Generator().manual_seed(5))
    seqs = [make_seq(i, temperature=1.0, seed=i) for i in range(200)]
    exact = Sampler(vocab, "cpu", batch_invariant=True).sample(logits.clone(), seqs).token_ids
    seqs = [make_seq(i, temperature=1.0, seed=i) for i in range(200)]
    default = Sampler(vocab, "cpu").sample(logits.clone(), seqs).token_ids
    assert sum(a == b for a, b in zip(exact, default)) >= 198
