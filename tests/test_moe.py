"""The fused MoE op: the contract's reference against a dense float64 definition, the CPU platform's
packed path against the reference, routing, and the expert-weight layout the loaders fill.

Expert counts 1-64, top-k 1/2/8, 1-4096 tokens. The float64 definition computes every (token, k)
pair with that token's own expert weights gathered, no grouping: a grouping bug (a token given
another expert's rows, a weight applied to the wrong pair) cannot pass it.
"""

from __future__ import annotations

from functools import partial

import pytest
import torch

from podium.models.moe import FusedMoE, route
from podium_cpu import CpuPlatform
from podium_cpu.fused_ops import cpu_ops
from podium_cpu.linear_packing import pack_linear_layers
from podium_cpu.moe import PACKED_ATTRIBUTE, pack_experts
from podium_cpu.native_kernels import load_kernels
from podium_plugin_api.moe import MoEExperts
from podium_plugin_api.ops import build_op_table, fused_moe

HIDDEN, INTER = 48, 40


def random_experts(num_experts: int, dtype=torch.float32, seed: int = 0, hidden=HIDDEN, inter=INTER) -> MoEExperts:
    gen = torch.Generator().manual_seed(seed)
    experts = MoEExperts(num_experts, hidden, inter)
    with torch.no_grad():
        experts.gate_up_proj.copy_(torch.randn(experts.gate_up_proj.shape, generator=gen) / hidden**0.5)
        experts.down_proj.copy_(torch.randn(experts.down_proj.shape, generator=gen) / inter**0.5)
    return experts.requires_grad_(False).to(dtype)


def random_routing(tokens: int, num_experts: int, top_k: int, seed: int = 1, hidden=HIDDEN):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=gen)
    weights, ids = route(torch.randn(tokens, num_experts, generator=gen) * 2, top_k, renormalize=bool(seed % 2))
    return x, weights, ids


def dense_float64(x, experts: MoEExperts, weights, ids) -> torch.Tensor:
    """Every (token, k) pair with its expert's weights gathered per token: no grouping at all."""
    x = x.double()
    gate_up, down = experts.gate_up_proj.double(), experts.down_proj.double()
    out = torch.zeros(x.shape, dtype=torch.float64)
    for k in range(ids.shape[1]):
        valid = ids[:, k] >= 0
        e = ids[:, k].clamp(min=0)
        h = torch.einsum("th,tnh->tn", x, gate_up[e])  # [T, 2I]
        g, u = h.chunk(2, dim=-1)
        y = torch.einsum("ti,thi->th", torch.nn.functional.silu(g) * u, down[e])  # [T, H]
        out += torch.where(valid[:, None], y * weights[:, k, None].double(), 0.0)
    return out


CASES = [(1, 1, 1), (1, 1, 33), (4, 2, 1), (4, 2, 7), (8, 1, 64), (8, 2, 4096), (8, 8, 9), (16, 8, 4096),
         (64, 8, 200), (64, 2, 1), (64, 1, 3)]


@pytest.mark.parametrize("num_experts, top_k, tokens", CASES)
def test_reference_equals_the_dense_definition(num_experts, top_k, tokens):
    experts = random_experts(num_experts, seed=num_experts)
    x, weights, ids = random_routing(tokens, num_experts, top_k, seed=tokens + top_k)
    got = fused_moe(x, experts, weights, ids)
    assert got.dtype == torch.float32 and got.shape == x.shape
    torch.testing.assert_close(got.double(), dense_float64(x, experts, weights, ids), rtol=1e-5, atol=1e-5)


def test_negative_ids_are_skipped():
    """Expert parallelism's contract: an assignment held by another rank (-1) adds nothing here."""
    experts = random_experts(4)
    x, weights, ids = random_routing(6, 4, 2)
    ids[::2, 1] = -1
    got = fused_moe(x, experts, weights, ids)
    torch.testing.assert_close(got.double(), dense_float64(x, experts, weights, ids), rtol=1e-5, atol=1e-5)
    only_first = fused_moe(x, experts, weights[:, :1], ids[:, :1])
    torch.testing.assert_close(got[::2], only_first[::2])


@pytest.mark.parametrize("renormalize", [False, True])
def test_route_is_softmax_then_top_k(renormalize):
    logits = torch.tensor([[1.0, 3.0, 2.0, -1.0], [0.0, 0.0, 5.0, 0.5]])
    weights, ids = route(logits, 2, renormalize)
    assert ids.tolist() == [[1, 2], [2, 3]]
    probs = torch.softmax(logits, -1)
    expected = torch.stack([probs[0, [1, 2]], probs[1, [2, 3]]])
    if renormalize:
        expected = expected / expected.sum(-1, keepdim=True)
    torch.testing.assert_close(weights, expected)
    assert weights.dtype == torch.float32


def test_fused_moe_module_maps_per_expert_checkpoint_names():
    experts = FusedMoE(3, HIDDEN, INTER, build_op_table())
    pieces = experts.checkpoint_pieces()
    assert pieces["2.gate_proj.weight"] == ("gate_up_proj", (2, 0, INTER))
    assert pieces["2.up_proj.weight"] == ("gate_up_proj", (2, INTER, INTER))
    assert pieces["0.down_proj.weight"] == ("down_proj", (0,))
    assert len(pieces) == 9


def test_experts_need_positive_sizes():
    with pytest.raises(ValueError, match="num_experts must be >= 1"):
        MoEExperts(0, HIDDEN, INTER)


# ----------------------------------------------------------------------------- the CPU platform's op
@pytest.fixture(scope="module")
def cpu_moe():
    return cpu_ops(load_kernels()[0])["fused_moe"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_experts, top_k, tokens", [(8, 2, 1), (8, 2, 4096), (4, 1, 13), (16, 8, 64),
                                                        (64, 8, 3)])
def test_cpu_packed_experts_equal_the_reference(cpu_moe, dtype, num_experts, top_k, tokens):
    experts = random_experts(num_experts, dtype=dtype, seed=num_experts, hidden=64, inter=96)
    x, weights, ids = random_routing(tokens, num_experts, top_k, hidden=64)
    x = x.to(dtype)
    want = fused_moe(x, experts, weights, ids)
    packed = pack_experts(experts, partial(pack_linear_layers, rules=CpuPlatform().linear_rules()))
    got = cpu_moe(x, experts, weights, ids)
    assert got.dtype == dtype and got.shape == x.shape
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    else:
        scale = want.float().abs().max()
        assert float((got.float() - want.float()).abs().max() / scale) < 2e-2
    assert packed == int(hasattr(experts, PACKED_ATTRIBUTE))  # unpacked dtypes run the reference, tested above


def test_cpu_op_without_packed_weights_is_the_reference(cpu_moe):
    experts = random_experts(4)
    x, weights, ids = random_routing(5, 4, 2)
    assert torch.equal(cpu_moe(x, experts, weights, ids), fused_moe(x, experts, weights, ids))
