"""The contract's batched LoRA ops (``podium_plugin_api.lora``) as two segmented Triton GEMMs (SGMV).

The step's rows arrive grouped by adapter slot (``LoRAMapping.sorted_rows`` / ``slot_starts``), so a
program computes a block of rows of one slot against that slot's weights only:

    shrink  grid (row blocks, S blocks x split-K, slots): out[rows, s] = x[rows] . lora_a[slot, s]
            over its share of K. With one split it stores the result; with several (a decode step's few
            rows over a K of thousands would leave most multiprocessors idle) each split adds its
            partial sum to a zeroed output with float32 atomics.
    expand  grid (row blocks, N blocks, slots): y[rows, n] += shrunk[rows] . lora_b[slot, n]
            over the whole S (it is small: ranks times slices), y read and written in place.

A program whose row block lies past its slot's rows returns at once; the grid's row extent is the
largest slot's row count where the host knows it (an eager step), else every row (a captured decode
graph, whose launches must not depend on the step), so a step captures into a CUDA graph and replays
for any mix of slots. Rows without a slot are in no slot's group: the expand never touches them.
float32 weights multiply in IEEE float32 (no TF32); bf16/fp16 ones on the tensor cores with float32
sums, the expand's shrunk operand rounded to the weights' dtype first.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from podium_plugin_api.lora import LoRAMapping

TARGET_PROGRAMS = 264  # two waves of the H200's 132 multiprocessors: where split-K stops


@dataclass(frozen=True)
class LoRATiling:
    block_m: int
    block_n: int  # shrink: the S tile; expand: the N tile
    block_k: int  # shrink: the K tile; expand: the S tile
    num_warps: int


DECODE = LoRATiling(16, 64, 64, 4)  # a few rows per slot: weights streamed once per row block
PREFILL = LoRATiling(64, 64, 64, 4)


def _tiling(rows_per_slot: int) -> LoRATiling:
    return DECODE if rows_per_slot <= 32 else PREFILL


def _row_extent(mapping: LoRAMapping) -> tuple[int, int]:
    """(the rows a program grid covers per slot, the rows one slot is expected to have)."""
    rows = mapping.num_rows
    if mapping.max_slot_rows is not None:
        return mapping.max_slot_rows, mapping.max_slot_rows
    return rows, -(-rows // max(mapping.num_slots, 1))  # a captured graph: any slot may hold every row


@triton.jit
def lora_shrink_kernel(
    x_ptr, a_ptr, out_ptr, rows_ptr, starts_ptr, S, K, k_chunk,
    stride_x, stride_al, stride_as, stride_out,
    SPLIT_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_K: tl.constexpr,
    IEEE: tl.constexpr,
):
    pid_m, pid_sk, slot = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    first = tl.load(starts_ptr + slot) + pid_m * BLOCK_M
    end = tl.load(starts_ptr + slot + 1)
    if first >= end:
        return
    pid_s, pid_k = pid_sk // SPLIT_K, pid_sk % SPLIT_K
    index = first + tl.arange(0, BLOCK_M)
    row_ok = index < end
    rows = tl.load(rows_ptr + index, mask=row_ok, other=0).to(tl.int64)
    cols = pid_s * BLOCK_S + tl.arange(0, BLOCK_S)
    col_ok = cols < S
    k_start = pid_k * k_chunk
    ks = k_start + tl.arange(0, BLOCK_K)
    x_tile = x_ptr + rows[:, None] * stride_x + ks[None, :]  # [BLOCK_M, BLOCK_K]
    a_tile = a_ptr + slot.to(tl.int64) * stride_al + cols[None, :].to(tl.int64) * stride_as + ks[:, None]
    acc = tl.zeros((BLOCK_M, BLOCK_S), dtype=tl.float32)
    k_end = tl.minimum(k_start + k_chunk, K)
    for k0 in range(k_start, k_end, BLOCK_K):
        k_ok = ks < k_end - (k0 - k_start)
        xs = tl.load(x_tile, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        ws = tl.load(a_tile, mask=k_ok[:, None] & col_ok[None, :], other=0.0)  # [BLOCK_K, BLOCK_S]
        if IEEE:
            acc = tl.dot(xs, ws, acc, input_precision="ieee")
        else:
            acc = tl.dot(xs, ws, acc)
        x_tile += BLOCK_K
        a_tile += BLOCK_K
    out = out_ptr + rows[:, None] * stride_out + cols[None, :]
    if SPLIT_K == 1:
        tl.store(out, acc, mask=row_ok[:, None] & col_ok[None, :])
    else:
        tl.atomic_add(out, acc, mask=row_ok[:, None] & col_ok[None, :], sem="relaxed")


@triton.jit
def lora_expand_kernel(
    y_ptr, s_ptr, b_ptr, rows_ptr, starts_ptr, N, S,
    stride_y, stride_s, stride_bl, stride_bn,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_S: tl.constexpr, IEEE: tl.constexpr,
):
    pid_m, pid_n, slot = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    first = tl.load(starts_ptr + slot) + pid_m * BLOCK_M
    end = tl.load(starts_ptr + slot + 1)
    if first >= end:
        return
    index = first + tl.arange(0, BLOCK_M)
    row_ok = index < end
    rows = tl.load(rows_ptr + index, mask=row_ok, other=0).to(tl.int64)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    ss = tl.arange(0, BLOCK_S)
    s_tile = s_ptr + rows[:, None] * stride_s + ss[None, :]  # [BLOCK_M, BLOCK_S] float32
    b_tile = b_ptr + slot.to(tl.int64) * stride_bl + cols[None, :].to(tl.int64) * stride_bn + ss[:, None]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for s0 in range(0, S, BLOCK_S):
        s_ok = ss < S - s0
        shrunk = tl.load(s_tile, mask=row_ok[:, None] & s_ok[None, :], other=0.0)
        ws = tl.load(b_tile, mask=s_ok[:, None] & col_ok[None, :], other=0.0)  # [BLOCK_S, BLOCK_N]
        if IEEE:
            acc = tl.dot(shrunk, ws.to(tl.float32), acc, input_precision="ieee")
        else:
            acc = tl.dot(shrunk.to(ws.dtype), ws, acc)
        s_tile += BLOCK_S
        b_tile += BLOCK_S
    out = y_ptr + rows[:, None] * stride_y + cols[None, :]
    mask = row_ok[:, None] & col_ok[None, :]
    y = tl.load(out, mask=mask, other=0.0)
    tl.store(out, (y.to(tl.float32) + acc).to(y_ptr.dtype.element_ty), mask=mask)


def _check(name: str, x: torch.Tensor, weights: torch.Tensor, mapping: LoRAMapping) -> None:
    if x.dtype != weights.dtype and name == "lora_shrink":
        raise ValueError(f"{name}: x ({x.dtype}) and the slot weights ({weights.dtype}) must share a dtype")
    if weights.stride(-1) != 1:
        raise ValueError(f"{name}: the slot weights' last dimension must be contiguous")
    if mapping.num_slots != weights.shape[0]:
        raise ValueError(f"{name}: the mapping has {mapping.num_slots} slots, the weights {weights.shape[0]}")


def _split_k(programs: int, k: int, block_k: int) -> int:
    """How many programs share one K: enough for ~TARGET_PROGRAMS, each keeping >= 4 tiles of K."""
    most = max(1, k // (4 * block_k))
    return max(1, min(most, -(-TARGET_PROGRAMS // max(programs, 1)), 32))


def lora_shrink(x: torch.Tensor, lora_a: torch.Tensor, mapping: LoRAMapping, tuning=None) -> torch.Tensor:
    """The contract's ``lora_shrink``: x [T, K], lora_a [L, S, K] -> [T, S] float32 (module docstring).
    ``tuning``: ignored (the ROCm platform passes its table to every op)."""
    _check("lora_shrink", x, lora_a, mapping)
    rows, k = x.shape
    slots, inner, _ = lora_a.shape
    extent, expected = _row_extent(mapping)
    tiling = _tiling(expected)
    block_s = min(tiling.block_n, max(16, triton.next_power_of_2(inner)))
    s_blocks = triton.cdiv(inner, block_s)
    split = _split_k(triton.cdiv(expected, tiling.block_m) * slots * s_blocks, k, tiling.block_k)
    k_chunk = triton.cdiv(triton.cdiv(k, split), tiling.block_k) * tiling.block_k
    split = triton.cdiv(k, k_chunk)
    out = (torch.zeros if split > 1 else torch.empty)(rows, inner, dtype=torch.float32, device=x.device)
    if rows == 0 or extent == 0:
        return out
    x = x if x.stride(-1) == 1 else x.contiguous()
    lora_shrink_kernel[(triton.cdiv(extent, tiling.block_m), s_blocks * split, slots)](
        x, lora_a, out, mapping.sorted_rows, mapping.slot_starts, inner, k, k_chunk,
        x.stride(0), lora_a.stride(0), lora_a.stride(1), out.stride(0),
        SPLIT_K=split, BLOCK_M=tiling.block_m, BLOCK_S=block_s, BLOCK_K=tiling.block_k,
        IEEE=x.dtype == torch.float32, num_warps=tiling.num_warps,
    )
    return out


def lora_expand(y: torch.Tensor, shrunk: torch.Tensor, lora_b: torch.Tensor, mapping: LoRAMapping,
                tuning=None) -> torch.Tensor:
    """The contract's ``lora_expand``: y [T, N] += lora_b[slot] . shrunk for each row with a slot; returns y."""
    _check("lora_expand", y, lora_b, mapping)
    if y.stride(-1) != 1 or shrunk.stride(-1) != 1:
        raise ValueError("lora_expand: y and shrunk need contiguous rows (y is written in place)")
    rows, n = y.shape
    slots, _, inner = lora_b.shape
    extent, expected = _row_extent(mapping)
    if rows == 0 or extent == 0:
        return y
    tiling = _tiling(expected)
    block_s = min(tiling.block_k, max(16, triton.next_power_of_2(inner)))
    lora_expand_kernel[(triton.cdiv(extent, tiling.block_m), triton.cdiv(n, tiling.block_n), slots)](
        y, shrunk, lora_b, mapping.sorted_rows, mapping.slot_starts, n, inner,
        y.stride(0), shrunk.stride(0), lora_b.stride(0), lora_b.stride(1),
        BLOCK_M=tiling.block_m, BLOCK_N=tiling.block_n, BLOCK_S=block_s, IEEE=lora_b.dtype == torch.float32,
        num_warps=tiling.num_warps,
    )
    return y


LORA_OPS = {"lora_shrink": lora_shrink, "lora_expand": lora_expand}
