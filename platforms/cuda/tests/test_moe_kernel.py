"""The Triton fused MoE kernel against the contract's pure-torch reference (``podium_plugin_api.moe``).

Expert counts 1-64, top-k 1/2/8, ids of -1 (experts held by another rank), every tiling. Under
``TRITON_INTERPRET=1`` (no GPU) the token counts stay small and float32 only; on the GPU up to 4096
tokens and bf16 too.
"""

from __future__ import annotations

import copy

import pytest
import torch

from podium_plugin_api.moe import MoEExperts
from podium_plugin_api.moe import fused_moe as reference

pytestmark = pytest.mark.cuda

CASES = [(1, 1), (4, 2), (8, 1), (8, 2), (8, 8), (64, 8)]  # (experts, top_k)


def experts_on(device, dtype, num_experts, hidden, inter, seed=0) -> MoEExperts:
    gen = torch.Generator().manual_seed(seed)
    experts = MoEExperts(num_experts, hidden, inter)
    with torch.no_grad():
        experts.gate_up_proj.copy_(torch.randn(experts.gate_up_proj.shape, generator=gen) / hidden**0.5)
        experts.down_proj.copy_(torch.randn(experts.down_proj.shape, generator=gen) / inter**0.5)
    return experts.requires_grad_(False).to(device=device, dtype=dtype)


def routing(tokens, num_experts, top_k, hidden, device, dtype, seed=1):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=gen)
    weights, ids = torch.randn(tokens, num_experts, generator=gen).softmax(-1).topk(top_k, dim=-1)
    if tokens > 2:
        ids[1, -1] = -1
    return x.to(device=device, dtype=dtype), weights.to(device), ids.to(device)


def token_counts(device) -> tuple[int, ...]:
    return (1, 5, 33) if device == "cpu" else (1, 7, 64, 256, 4096)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_experts, top_k", CASES)
def test_kernel_equals_the_reference(kernel_device, check_dtype, dtype, num_experts, top_k):
    from podium_cuda.moe import fused_moe

    check_dtype(dtype)
    hidden, inter = (64, 48) if kernel_device == "cpu" else (256, 320)
    experts = experts_on(kernel_device, dtype, num_experts, hidden, inter, seed=num_experts)
    reference_experts = copy.deepcopy(experts).float()  # Module.float() converts in place
    for tokens in token_counts(kernel_device):
        x, weights, ids = routing(tokens, num_experts, top_k, hidden, kernel_device, dtype, seed=tokens)
        got = fused_moe(x, experts, weights, ids)
        want = reference(x.float(), reference_experts, weights, ids)
        assert got.dtype == dtype and got.shape == x.shape
        error = float((got.float() - want).abs().max() / want.abs().max())
        assert error < (1e-5 if dtype == torch.float32 else 2e-2), f"{tokens} tokens: relative error {error}"


@pytest.mark.parametrize("block_m", [16, 32, 64])
def test_every_tiling_gives_the_same_result(kernel_device, block_m):
    from podium_cuda.moe import MoETiling, fused_moe

    experts = experts_on(kernel_device, torch.float32, 8, 64, 80)
    x, weights, ids = routing(9, 8, 2, 64, kernel_device, torch.float32)
    tiling = MoETiling(block_m, 32, 32, 4, 2)
    torch.testing.assert_close(fused_moe(x, experts, weights, ids, tiling=tiling), reference(x, experts, weights, ids),
                               rtol=1e-5, atol=1e-5)


def test_alignment_groups_every_assignment_once_by_expert(kernel_device):
    from podium_cuda.moe import align_by_expert

    ids = torch.tensor([[3, 0], [3, -1], [1, 3], [0, 2]], device=kernel_device)
    sorted_ids, block_expert = align_by_expert(ids, num_experts=4, block_m=4)
    assert sorted_ids.numel() % 4 == 0 and sorted_ids.numel() == block_expert.numel() * 4
    flat = ids.reshape(-1).tolist()
    blocks = sorted_ids.view(-1, 4).tolist()
    seen = []
    for expert, block in zip(block_expert.tolist(), blocks):
        real = [a for a in block if a < len(flat)]
        seen += real
        assert all(flat[a] == expert or (expert == -1 and flat[a] < 0) for a in real), (expert, block)
    assert sorted(seen) == list(range(len(flat)))
    assert block_expert.tolist()[:4] == [0, 1, 2, 3]
