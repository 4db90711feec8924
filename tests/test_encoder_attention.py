"""The contract's ``encoder_attention`` reference against dense attention written here, one sequence
at a time in float64: bidirectional within a sequence, nothing across sequences."""

from __future__ import annotations

import pytest
import torch

from podium_plugin_api.ops import REFERENCE_OPS
from podium_plugin_api.testing.op_checks import check_op


def dense(q, k, v, scale):
    """q [L, H, D], k/v [L, Hkv, D] -> softmax(q k^T * scale) v, every token seeing every token."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    probs = torch.softmax(torch.einsum("qhd,khd->hqk", q, k) * scale, dim=-1)
    return torch.einsum("hqk,khd->qhd", probs, v)


@pytest.mark.parametrize("lens", [(5,), (1, 7, 3), (4, 4, 1, 9, 2)])
@pytest.mark.parametrize("kv_heads", [4, 2])
def test_matches_dense_attention_per_sequence(lens, kv_heads):
    gen = torch.Generator().manual_seed(len(lens) * 10 + kv_heads)
    tokens, heads, dim = sum(lens), 4, 16
    q = torch.randn(tokens, heads, dim, generator=gen)
    k, v = (torch.randn(tokens, kv_heads, dim, generator=gen) for _ in range(2))
    starts = torch.tensor([0, *lens]).cumsum(0)
    got = REFERENCE_OPS["encoder_attention"](q, k, v, starts.to(torch.int32), list(lens), dim**-0.5)
    for i in range(len(lens)):
        lo, hi = int(starts[i]), int(starts[i + 1])
        want = dense(q[lo:hi].double(), k[lo:hi].double(), v[lo:hi].double(), dim**-0.5)
        torch.testing.assert_close(got[lo:hi].double(), want, atol=1e-5, rtol=1e-5)


def test_a_future_token_changes_earlier_outputs():
    """Bidirectional: changing the last token's key changes the first token's output (causal would not),
    and changing another sequence's tokens changes nothing."""
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(6, 2, 8, generator=gen) for _ in range(3))
    starts, lens = torch.tensor([0, 3, 6], dtype=torch.int32), [3, 3]
    op = REFERENCE_OPS["encoder_attention"]
    base = op(q, k, v, starts, lens, 0.5)
    k2 = k.clone()
    k2[2] += 1.0
    changed = op(q, k2, v, starts, lens, 0.5)
    assert not torch.allclose(changed[0], base[0])
    torch.testing.assert_close(changed[3:], base[3:])


def test_kit_checks_an_override_against_the_reference():
    """The conformance kit has cases for the op: the reference passes; a causal impostor fails."""
    check_op("encoder_attention", REFERENCE_OPS["encoder_attention"], torch.float32, torch.device("cpu"), "reference")

    def causal(q, k, v, starts, lens, scale):
        out = torch.empty_like(q)
        for i, n in enumerate(lens):
            lo = int(starts[i])
            qs, ks, vs = (x[lo:lo + n].transpose(0, 1) for x in (q, k, v))
            out[lo:lo + n] = torch.nn.functional.scaled_dot_product_attention(
                qs, ks, vs, is_causal=True, scale=scale, enable_gqa=True).transpose(0, 1)
        return out

    with pytest.raises(Exception, match="encoder_attention"):
        check_op("encoder_attention", causal, torch.float32, torch.device("cpu"), "impostor")
