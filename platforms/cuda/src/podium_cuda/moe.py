"""The contract's ``fused_moe`` as two Triton grouped GEMMs over tokens sorted by expert.

    A = T * K assignments (token t, choice k), flat index a = t * K + k
    1. align (torch, on the device, no host sync): sort the assignments by expert and pad each
       expert's run to a multiple of BLOCK_M, so every BLOCK_M rows of ``sorted_ids`` belong to one
       expert (``block_expert``; -1: padding past the end, or ids < 0, held by another rank)
    2. gate_up kernel: per (row block, column block of I) one program computes
       x[rows] @ W_gate[e]^T and x[rows] @ W_up[e]^T in two accumulators and stores
       silu(gate) * up [BLOCK_M, BLOCK_N] at the assignments' rows of ``act`` [A, I]
    3. down kernel: act[rows] @ W_down[e]^T times each assignment's routing weight -> out [A, H]
       (float32; rows routed to no local expert get zeros)
    4. out.view(T, K, H).sum(1): each token's K contributions, in a fixed order (in the
       batch-invariant mode one elementwise add after another: ``invariant_fused_moe``)

Every size is static (``sorted_ids`` holds A + (E + 1) * (BLOCK_M - 1) slots, rounded up), so a
decode step with MoE layers captures into a CUDA graph; empty blocks return at once. BLOCK_K is the
same at every batch size, so a row's sums run in one order whatever else is in the batch. float32
weights multiply in IEEE float32 (no TF32), as the reference does.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from podium_plugin_api.moe import MoEExperts


@dataclass(frozen=True)
class MoETiling:
    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


# by assignments per expert (A / E): small row blocks for decode (weights streamed once per block),
# larger ones for prefill (each weight tile reused over more rows); BLOCK_K fixed (module docstring)
MOE_TILINGS = ((16, MoETiling(16, 64, 64, 4, 4)), (64, MoETiling(32, 64, 64, 4, 4)),
               (1 << 62, MoETiling(64, 128, 64, 8, 3)))


def moe_tiling(assignments: int, num_experts: int) -> MoETiling:
    per_expert = -(-assignments // num_experts)
    return next(tiling for limit, tiling in MOE_TILINGS if per_expert <= limit)


def align_by_expert(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(sorted_ids [S] int32, block_expert [S / block_m] int32), S static (module docstring, step 1).

    sorted_ids holds assignment indices grouped by expert, each group padded with A (no assignment)."""
    flat = topk_ids.reshape(-1).long()
    count = flat.numel()
    groups = num_experts + 1  # the last: ids < 0
    keyed = torch.where(flat < 0, num_experts, flat)
    counts = torch.zeros(groups, dtype=torch.long, device=flat.device).scatter_add_(0, keyed, torch.ones_like(keyed))
    padded_end = torch.cumsum((counts + block_m - 1) // block_m * block_m, 0)  # [G]
    padded_start = padded_end - (counts + block_m - 1) // block_m * block_m
    start = torch.cumsum(counts, 0) - counts
    order = torch.argsort(keyed, stable=True)
    ranked = keyed[order]
    slots = padded_start[ranked] + torch.arange(count, device=flat.device) - start[ranked]
    capacity = -(-(count + groups * (block_m - 1)) // block_m) * block_m
    sorted_ids = torch.full((capacity,), count, dtype=torch.int32, device=flat.device)
    sorted_ids[slots] = order.to(torch.int32)
    block_starts = torch.arange(0, capacity, block_m, device=flat.device)
    block_group = torch.searchsorted(padded_end, block_starts, right=True)
    block_expert = torch.where(block_group < num_experts, block_group, -1).to(torch.int32)
    return sorted_ids, block_expert


@triton.jit
def moe_gate_up_kernel(
    x_ptr, w_ptr, act_ptr, sorted_ptr, expert_ptr, num_assign, top_k, N, K,
    stride_x, stride_we, stride_wn, stride_act,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, IEEE: tl.constexpr,
):
    """act[a, n] = silu(x[a // K] . W[e, n]) * (x[a // K] . W[e, N + n]) for the block's assignments a."""
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    expert = tl.load(expert_ptr + pid_m)
    if expert < 0:
        return
    assign = tl.load(sorted_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    valid = assign < num_assign
    rows = (assign // top_k).to(tl.int64)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    ks = tl.arange(0, BLOCK_K)
    x_tile = x_ptr + rows[:, None] * stride_x + ks[None, :]  # [BLOCK_M, BLOCK_K]
    gate_tile = w_ptr + expert.to(tl.int64) * stride_we + cols[None, :].to(tl.int64) * stride_wn + ks[:, None]
    up_tile = gate_tile + N * stride_wn  # [BLOCK_K, BLOCK_N] each
    gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = ks < K - k0
        a = tl.load(x_tile, mask=valid[:, None] & k_ok[None, :], other=0.0)
        wg = tl.load(gate_tile, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        wu = tl.load(up_tile, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        if IEEE:
            gate = tl.dot(a, wg, gate, input_precision="ieee")
            up = tl.dot(a, wu, up, input_precision="ieee")
        else:
            gate = tl.dot(a, wg, gate)
            up = tl.dot(a, wu, up)
        x_tile += BLOCK_K
        gate_tile += BLOCK_K
        up_tile += BLOCK_K
    act = gate / (1.0 + tl.exp(-gate)) * up
    out = act_ptr + assign[:, None].to(tl.int64) * stride_act + cols[None, :]
    tl.store(out, act.to(act_ptr.dtype.element_ty), mask=valid[:, None] & col_ok[None, :])


@triton.jit
def moe_down_kernel(
    act_ptr, w_ptr, out_ptr, sorted_ptr, expert_ptr, weight_ptr, num_assign, N, K,
    stride_act, stride_we, stride_wn, stride_out,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, IEEE: tl.constexpr,
):
    """out[a, n] = weight[a] * (act[a] . W[e, n]) for the block's assignments a (zeros where e < 0)."""
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    expert = tl.load(expert_ptr + pid_m)
    assign = tl.load(sorted_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    valid = assign < num_assign
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    out = out_ptr + assign[:, None].to(tl.int64) * stride_out + cols[None, :]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if expert >= 0:
        ks = tl.arange(0, BLOCK_K)
        a_tile = act_ptr + assign[:, None].to(tl.int64) * stride_act + ks[None, :]  # [BLOCK_M, BLOCK_K]
        w_tile = w_ptr + expert.to(tl.int64) * stride_we + cols[None, :].to(tl.int64) * stride_wn + ks[:, None]
        for k0 in range(0, K, BLOCK_K):
            k_ok = ks < K - k0
            a = tl.load(a_tile, mask=valid[:, None] & k_ok[None, :], other=0.0)
            w = tl.load(w_tile, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
            if IEEE:
                acc = tl.dot(a, w, acc, input_precision="ieee")
            else:
                acc = tl.dot(a, w, acc)
            a_tile += BLOCK_K
            w_tile += BLOCK_K
        acc *= tl.load(weight_ptr + assign, mask=valid, other=0.0)[:, None]
    tl.store(out, acc, mask=valid[:, None] & col_ok[None, :])


def fused_moe(x: torch.Tensor, experts: MoEExperts, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
              tuning=None, tiling: MoETiling | None = None) -> torch.Tensor:
    """The contract's ``fused_moe`` (module docstring). ``tuning``: ignored (the ROCm platform passes
    its table to every op); ``tiling``: force one (benchmarks)."""
    if x.shape[0] == 0:
        return torch.empty_like(x)
    tiling = tiling or moe_tiling(topk_ids.numel(), experts.gate_up_proj.shape[0])
    return _contributions(x, experts, topk_weights, topk_ids, tiling).sum(dim=1).to(x.dtype)  # [T, H]


# the batch-invariant mode's one tiling, whatever the batch (the prefill one: decode steps pay for
# 64-row blocks of which few rows are used)
INVARIANT_MOE_TILING = MOE_TILINGS[-1][1]


def invariant_fused_moe(x: torch.Tensor, experts: MoEExperts, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                        tuning=None) -> torch.Tensor:
    """``fused_moe`` whose token rows do not depend on the batch: one tiling (``INVARIANT_MOE_TILING``)
    at every size, and each token's K contributions added one after another by elementwise adds,
    where ``sum(dim=1)`` would leave the order to the reduction torch configures for the shape."""
    if x.shape[0] == 0:
        return torch.empty_like(x)
    parts = _contributions(x, experts, topk_weights, topk_ids, INVARIANT_MOE_TILING)  # [T, K, H] float32
    total = parts[:, 0]
    for k in range(1, parts.shape[1]):
        total = total + parts[:, k]
    return total.to(x.dtype)


def _contributions(x: torch.Tensor, experts: MoEExperts, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                   tiling: MoETiling) -> torch.Tensor:
    """Steps 1-3 of the module docstring: each assignment's weighted expert output, [T, K, H] float32."""
    gate_up, down = experts.gate_up_proj, experts.down_proj  # [E, 2I, H], [E, H, I]
    tokens, hidden = x.shape
    num_experts, inter = gate_up.shape[0], gate_up.shape[1] // 2
    count = topk_ids.numel()
    if x.dtype != gate_up.dtype or gate_up.stride(-1) != 1 or down.stride(-1) != 1:
        raise ValueError(f"fused_moe: x ({x.dtype}) and expert weights ({gate_up.dtype}) must share a dtype, "
                         "with contiguous rows")
    x = x if x.stride(-1) == 1 else x.contiguous()
    sorted_ids, block_expert = align_by_expert(topk_ids, num_experts, tiling.block_m)
    blocks, ieee = block_expert.numel(), x.dtype == torch.float32
    act = torch.empty(count, inter, dtype=x.dtype, device=x.device)  # [A, I]
    moe_gate_up_kernel[(blocks, triton.cdiv(inter, tiling.block_n))](
        x, gate_up, act, sorted_ids, block_expert, count, topk_ids.shape[1], inter, hidden,
        x.stride(0), gate_up.stride(0), gate_up.stride(1), act.stride(0),
        BLOCK_M=tiling.block_m, BLOCK_N=tiling.block_n, BLOCK_K=tiling.block_k, IEEE=ieee,
        num_warps=tiling.num_warps, num_stages=tiling.num_stages,
    )
    out = torch.empty(count, hidden, dtype=torch.float32, device=x.device)  # [A, H]
    weights = topk_weights.reshape(-1).float().contiguous()
    moe_down_kernel[(blocks, triton.cdiv(hidden, tiling.block_n))](
        act, down, out, sorted_ids, block_expert, weights, count, hidden, inter,
        act.stride(0), down.stride(0), down.stride(1), out.stride(0),
        BLOCK_M=tiling.block_m, BLOCK_N=tiling.block_n, BLOCK_K=tiling.block_k, IEEE=ieee,
        num_warps=tiling.num_warps, num_stages=tiling.num_stages,
    )
    return out.view(tokens, topk_ids.shape[1], hidden)
