"""The contract's batched LoRA ops (``podium_plugin_api.lora``) as two segmented Triton GEMMs (SGMV).

The step's rows arrive grouped by adapter slot (``LoRAMapping.sorted_rows``, ascending slots, the
rows without one last), so a program takes a block of BLOCK_M consecutive sorted rows and computes
them against their slots' weights, one slot at a time (a block meets one slot, or a few at its
groups' boundaries):

    shrink  grid (row blocks, S blocks x split-K): out[rows, s] = x[rows] . lora_a[slot, s] over its
            share of K. With one split it stores the result; with several (a decode step's few rows
            over a K of thousands would leave most multiprocessors idle) each split adds its partial
            sum to a zeroed output with float32 atomics.
    expand  grid (row blocks, N blocks): y[rows, n] += shrunk[rows] . lora_b[slot, n] over the whole
            S (it is small: ranks times slices), summed over the block's slots in registers, then y
            read and written once, in place.
    fused   lora_shrink_expand: both as one launch (decode steps' launches are mostly latency; each
            projection's two, and the split-K memset, become one memset and one kernel), the expand's
            pieces waiting on their row block's shrink pieces (lora_fused_kernel). Not in the op table
            yet: benchmarks/lora_kernel_bench.py times it against the two launches first.

The grid covers the rows that have a slot where the host knows how many (an eager step), else every
row (a captured decode graph, whose launches must not depend on the step): a block whose first row
has no slot returns at once, so a step captures into a CUDA graph and replays for any mix of slots,
and the grid never grows with the number of slots. Rows without a slot are in no slot's group: the
expand never touches them. float32 weights multiply in IEEE float32 (no TF32); bf16/fp16 ones on
the tensor cores with float32 sums, the expand's shrunk operand rounded to the weights' dtype first.
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
    # the shrink splits K until about this many programs run (each keeping >= 4 tiles of K): a
    # prefill's few row blocks per slot would otherwise each stream a long K one tile at a time
    target_programs: int = TARGET_PROGRAMS


# a few rows per slot: weights streamed once per row block. M32 N64 took 62.4 us per 8B layer at 256
# decode rows over 8 adapters on the H200, M16 N64 70.4, M32 N128 64.3, M64 N128 75.6
# (benchmarks/lora_kernel_bench.py times them all against the default)
DECODE = LoRATiling(32, 64, 64, 4)
PREFILL = LoRATiling(64, 64, 64, 4)
# decode steps run shrink and expand as one launch (lora_shrink_expand), where the engine asks for it;
# benchmarks/lora_kernel_bench.py times that against the two launches
FUSED_MAX_INNER = 128  # the fused kernel holds a block's whole shrunk rows [BLOCK_M, S] in registers


def _tiling(rows_per_slot: int) -> LoRATiling:
    return DECODE if rows_per_slot <= 32 else PREFILL


def _row_extent(mapping: LoRAMapping) -> tuple[int, int]:
    """(the sorted rows a program grid covers, the rows one slot is expected to have)."""
    rows = mapping.num_rows
    extent = rows if mapping.num_slotted_rows is None else mapping.num_slotted_rows
    if mapping.max_slot_rows is not None:
        return extent, mapping.max_slot_rows
    return extent, -(-rows // max(mapping.num_slots, 1))  # a captured graph: any slot may hold every row


@triton.jit
def _block_rows(rows_ptr, slots_ptr, num_rows, pid_m, BLOCK_M: tl.constexpr):
    """The block's rows (int64), each one's slot (-1: none, or past the rows), its first slot and its
    last (int64: they offset the slot weights)."""
    index = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    in_range = index < num_rows
    rows = tl.load(rows_ptr + index, mask=in_range, other=0).to(tl.int64)
    row_slots = tl.load(slots_ptr + rows, mask=in_range, other=-1)
    first = tl.load(slots_ptr + tl.load(rows_ptr + pid_m * BLOCK_M))  # sorted: the block's smallest slot
    return rows, row_slots, first.to(tl.int64), tl.max(row_slots, axis=0).to(tl.int64)


@triton.jit
def lora_shrink_kernel(
    x_ptr, a_ptr, out_ptr, rows_ptr, slots_ptr, num_rows, S, K, k_chunk,
    stride_x, stride_al, stride_as, stride_out,
    SPLIT_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_K: tl.constexpr,
    IEEE: tl.constexpr,
):
    pid_m, pid_sk = tl.program_id(0), tl.program_id(1)
    rows, row_slots, first, last = _block_rows(rows_ptr, slots_ptr, num_rows, pid_m, BLOCK_M)
    if first < 0:  # no row of the block has a slot (nor does any later block's)
        return
    pid_s, pid_k = pid_sk // SPLIT_K, pid_sk % SPLIT_K
    cols = pid_s * BLOCK_S + tl.arange(0, BLOCK_S)
    col_ok = cols < S
    k_start = pid_k * k_chunk
    ks = k_start + tl.arange(0, BLOCK_K)
    x_tile = x_ptr + rows[:, None] * stride_x + ks[None, :]  # [BLOCK_M, BLOCK_K]
    a_cols = a_ptr + cols[None, :].to(tl.int64) * stride_as + ks[:, None]  # [BLOCK_K, BLOCK_S] of slot 0
    k_end = tl.minimum(k_start + k_chunk, K)
    for slot in range(first, last + 1):
        mine = row_slots == slot  # the other slots' rows load as zeros and are not stored
        a_tile = a_cols + slot * stride_al
        acc = tl.zeros((BLOCK_M, BLOCK_S), dtype=tl.float32)
        for k0 in range(k_start, k_end, BLOCK_K):
            k_ok = ks < k_end - (k0 - k_start)
            xs = tl.load(x_tile + (k0 - k_start), mask=mine[:, None] & k_ok[None, :], other=0.0)
            ws = tl.load(a_tile + (k0 - k_start), mask=k_ok[:, None] & col_ok[None, :], other=0.0)
            if IEEE:
                acc = tl.dot(xs, ws, acc, input_precision="ieee")
            else:
                acc = tl.dot(xs, ws, acc)
        out = out_ptr + rows[:, None] * stride_out + cols[None, :]
        if SPLIT_K == 1:
            tl.store(out, acc, mask=mine[:, None] & col_ok[None, :])
        else:
            tl.atomic_add(out, acc, mask=mine[:, None] & col_ok[None, :], sem="relaxed")


@triton.jit
def lora_expand_kernel(
    y_ptr, s_ptr, b_ptr, rows_ptr, slots_ptr, num_rows, N, S,
    stride_y, stride_s, stride_bl, stride_bn,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_S: tl.constexpr, IEEE: tl.constexpr,
):
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    rows, row_slots, first, last = _block_rows(rows_ptr, slots_ptr, num_rows, pid_m, BLOCK_M)
    if first < 0:
        return
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    ss = tl.arange(0, BLOCK_S)
    s_tile = s_ptr + rows[:, None] * stride_s + ss[None, :]  # [BLOCK_M, BLOCK_S] float32
    b_cols = b_ptr + cols[None, :].to(tl.int64) * stride_bn + ss[:, None]  # [BLOCK_S, BLOCK_N] of slot 0
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for slot in range(first, last + 1):
        mine = row_slots == slot  # zero rows of the other slots add nothing to their sums
        b_tile = b_cols + slot * stride_bl
        for s0 in range(0, S, BLOCK_S):
            s_ok = ss < S - s0
            shrunk = tl.load(s_tile + s0, mask=mine[:, None] & s_ok[None, :], other=0.0)
            ws = tl.load(b_tile + s0, mask=s_ok[:, None] & col_ok[None, :], other=0.0)  # [BLOCK_S, BLOCK_N]
            if IEEE:
                acc = tl.dot(shrunk, ws.to(tl.float32), acc, input_precision="ieee")
            else:
                acc = tl.dot(shrunk.to(ws.dtype), ws, acc)
    out = y_ptr + rows[:, None] * stride_y + cols[None, :]
    mask = (row_slots >= 0)[:, None] & col_ok[None, :]
    y = tl.load(out, mask=mask, other=0.0)
    tl.store(out, (y.to(tl.float32) + acc).to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def lora_fused_kernel(
    x_ptr, a_ptr, y_ptr, b_ptr, shrunk_ptr, sync_ptr, rows_ptr, slots_ptr, num_rows, K, N, S, k_chunk,
    num_shrink, row_blocks,
    stride_x, stride_al, stride_as, stride_y, stride_s, stride_bl, stride_bn,
    SPLIT_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_S: tl.constexpr,
    BLOCK_K: tl.constexpr, IEEE: tl.constexpr,
):
    """Shrink and expand in one launch. Each program takes a ticket (``sync_ptr[0]``, zeroed): the first
    ``num_shrink`` tickets are the shrink's (row block, K split) pieces, which add their partial sums
    into the zeroed ``shrunk`` then count themselves done in ``sync_ptr[1 + row block]``; the later
    tickets are the expand's (row block, N tile) pieces, which wait until their row block's K splits are
    all done. Tickets, not program ids, order the work: a program waits only on ones that took a ticket
    before it, so are already running, and the wait cannot deadlock however the GPU schedules programs."""
    ticket = tl.atomic_add(sync_ptr, 1)
    if ticket < num_shrink:
        pid_m, pid_k = ticket // SPLIT_K, ticket % SPLIT_K
        rows, row_slots, first, last = _block_rows(rows_ptr, slots_ptr, num_rows, pid_m, BLOCK_M)
        if first >= 0:
            cols = tl.arange(0, BLOCK_S)
            col_ok = cols < S
            k_start = pid_k * k_chunk
            ks = k_start + tl.arange(0, BLOCK_K)
            x_tile = x_ptr + rows[:, None] * stride_x + ks[None, :]
            a_cols = a_ptr + cols[None, :].to(tl.int64) * stride_as + ks[:, None]
            k_end = tl.minimum(k_start + k_chunk, K)
            for slot in range(first, last + 1):
                mine = row_slots == slot
                a_tile = a_cols + slot * stride_al
                acc = tl.zeros((BLOCK_M, BLOCK_S), dtype=tl.float32)
                for k0 in range(k_start, k_end, BLOCK_K):
                    k_ok = ks < k_end - (k0 - k_start)
                    xs = tl.load(x_tile + (k0 - k_start), mask=mine[:, None] & k_ok[None, :], other=0.0)
                    ws = tl.load(a_tile + (k0 - k_start), mask=k_ok[:, None] & col_ok[None, :], other=0.0)
                    if IEEE:
                        acc = tl.dot(xs, ws, acc, input_precision="ieee")
                    else:
                        acc = tl.dot(xs, ws, acc)
                out = shrunk_ptr + rows[:, None] * stride_s + cols[None, :]
                tl.atomic_add(out, acc, mask=mine[:, None] & col_ok[None, :], sem="relaxed")
            # every thread's partial sums are in before one thread publishes them (CUTLASS's semaphore)
            tl.debug_barrier()
            tl.atomic_add(sync_ptr + 1 + pid_m, 1, sem="release")
    else:
        piece = ticket - num_shrink
        pid_m, pid_n = piece % row_blocks, piece // row_blocks
        rows, row_slots, first, last = _block_rows(rows_ptr, slots_ptr, num_rows, pid_m, BLOCK_M)
        if first >= 0:
            done = tl.atomic_add(sync_ptr + 1 + pid_m, 0, sem="acquire")
            while done < SPLIT_K:
                done = tl.atomic_add(sync_ptr + 1 + pid_m, 0, sem="acquire")
            cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
            col_ok = cols < N
            ss = tl.arange(0, BLOCK_S)
            s_ok = ss < S
            s_tile = shrunk_ptr + rows[:, None] * stride_s + ss[None, :]
            b_cols = b_ptr + cols[None, :].to(tl.int64) * stride_bn + ss[:, None]
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for slot in range(first, last + 1):
                mine = row_slots == slot
                # other programs' sums: the acquire above orders these loads after them (.cg: not from L1)
                shrunk = tl.load(s_tile, mask=mine[:, None] & s_ok[None, :], other=0.0, cache_modifier=".cg")
                ws = tl.load(b_cols + slot * stride_bl, mask=s_ok[:, None] & col_ok[None, :], other=0.0)
                if IEEE:
                    acc = tl.dot(shrunk, ws.to(tl.float32), acc, input_precision="ieee")
                else:
                    acc = tl.dot(shrunk.to(ws.dtype), ws, acc)
            out = y_ptr + rows[:, None] * stride_y + cols[None, :]
            mask = (row_slots >= 0)[:, None] & col_ok[None, :]
            y = tl.load(out, mask=mask, other=0.0)
            tl.store(out, (y.to(tl.float32) + acc).to(y_ptr.dtype.element_ty), mask=mask)


def _check(name: str, x: torch.Tensor, weights: torch.Tensor, mapping: LoRAMapping) -> None:
    if x.dtype != weights.dtype and name == "lora_shrink":
        raise ValueError(f"{name}: x ({x.dtype}) and the slot weights ({weights.dtype}) must share a dtype")
    if weights.stride(-1) != 1:
        raise ValueError(f"{name}: the slot weights' last dimension must be contiguous")
    if mapping.num_slots != weights.shape[0]:
        raise ValueError(f"{name}: the mapping has {mapping.num_slots} slots, the weights {weights.shape[0]}")
    if mapping.num_rows != x.shape[0]:
        raise ValueError(f"{name}: the mapping has {mapping.num_rows} rows, the input {x.shape[0]}")


def _split_k(programs: int, k: int, block_k: int, target: int = TARGET_PROGRAMS) -> int:
    """How many programs share one K: enough for ~``target`` programs, each keeping >= 4 tiles of K."""
    most = max(1, k // (4 * block_k))
    return max(1, min(most, -(-target // max(programs, 1)), 32))


def lora_shrink(x: torch.Tensor, lora_a: torch.Tensor, mapping: LoRAMapping, tuning=None) -> torch.Tensor:
    """The contract's ``lora_shrink``: x [T, K], lora_a [L, S, K] -> [T, S] float32 (module docstring).
    ``tuning``: ignored (the ROCm platform passes its table to every op)."""
    _check("lora_shrink", x, lora_a, mapping)
    rows, k = x.shape
    inner = lora_a.shape[1]
    extent, expected = _row_extent(mapping)
    tiling = _tiling(expected)
    block_s = min(tiling.block_n, max(16, triton.next_power_of_2(inner)))
    s_blocks = triton.cdiv(inner, block_s)
    split = _split_k(triton.cdiv(extent, tiling.block_m) * s_blocks, k, tiling.block_k, tiling.target_programs)
    k_chunk = triton.cdiv(triton.cdiv(k, split), tiling.block_k) * tiling.block_k
    split = triton.cdiv(k, k_chunk)
    out = (torch.zeros if split > 1 else torch.empty)(rows, inner, dtype=torch.float32, device=x.device)
    if rows == 0 or extent == 0:
        return out
    x = x if x.stride(-1) == 1 else x.contiguous()
    lora_shrink_kernel[(triton.cdiv(extent, tiling.block_m), s_blocks * split)](
        x, lora_a, out, mapping.sorted_rows, mapping.token_slots, rows, inner, k, k_chunk,
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
    inner = lora_b.shape[2]
    extent, expected = _row_extent(mapping)
    if rows == 0 or extent == 0:
        return y
    tiling = _tiling(expected)
    block_s = min(tiling.block_k, max(16, triton.next_power_of_2(inner)))
    lora_expand_kernel[(triton.cdiv(extent, tiling.block_m), triton.cdiv(n, tiling.block_n))](
        y, shrunk, lora_b, mapping.sorted_rows, mapping.token_slots, rows, n, inner,
        y.stride(0), shrunk.stride(0), lora_b.stride(0), lora_b.stride(1),
        BLOCK_M=tiling.block_m, BLOCK_N=tiling.block_n, BLOCK_S=block_s, IEEE=lora_b.dtype == torch.float32,
        num_warps=tiling.num_warps,
    )
    return y


def lora_shrink_expand(y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
                       mapping: LoRAMapping, tiling: LoRATiling | None = None) -> torch.Tensor:
    """``lora_expand(y, lora_shrink(x, lora_a, mapping), lora_b, mapping)`` as one launch (after one
    memset of its scratch): ``lora_fused_kernel``. For decode steps, whose two launches per projection
    are mostly latency (256 rows at rank 16 are little work); ``tiling``: the decode tiling's by default.
    An inner size past ``FUSED_MAX_INNER`` takes the two launches."""
    _check("lora_shrink", x, lora_a, mapping)
    _check("lora_expand", y, lora_b, mapping)
    if y.stride(-1) != 1:
        raise ValueError("lora_shrink_expand: y needs contiguous rows (it is written in place)")
    if x.shape[0] != y.shape[0] or lora_a.shape[1] != lora_b.shape[2]:
        raise ValueError(f"lora_shrink_expand: x {tuple(x.shape)}, y {tuple(y.shape)}, lora_a {tuple(lora_a.shape)} "
                         f"and lora_b {tuple(lora_b.shape)} disagree")
    rows, k = x.shape
    n, inner = y.shape[1], lora_a.shape[1]
    if inner > FUSED_MAX_INNER:
        return lora_expand(y, lora_shrink(x, lora_a, mapping), lora_b, mapping)
    extent, _ = _row_extent(mapping)
    if rows == 0 or extent == 0:
        return y
    tiling = tiling or DECODE
    block_s = max(16, triton.next_power_of_2(inner))
    row_blocks = triton.cdiv(extent, tiling.block_m)
    split = _split_k(row_blocks, k, tiling.block_k, tiling.target_programs)
    k_chunk = triton.cdiv(triton.cdiv(k, split), tiling.block_k) * tiling.block_k
    split = triton.cdiv(k, k_chunk)
    # one zeroed scratch (one memset): the shrunk rows (float32 zeros are int32 zeros), the ticket
    # counter and each row block's count of finished K splits
    scratch = torch.zeros(rows * inner + 1 + row_blocks, dtype=torch.int32, device=x.device)
    shrunk = scratch[: rows * inner].view(torch.float32).view(rows, inner)
    x = x if x.stride(-1) == 1 else x.contiguous()
    num_shrink = row_blocks * split
    grid = (num_shrink + row_blocks * triton.cdiv(n, tiling.block_n),)
    lora_fused_kernel[grid](
        x, lora_a, y, lora_b, shrunk, scratch[rows * inner:], mapping.sorted_rows, mapping.token_slots, rows, k, n,
        inner, k_chunk, num_shrink, row_blocks,
        x.stride(0), lora_a.stride(0), lora_a.stride(1), y.stride(0), shrunk.stride(0), lora_b.stride(0),
        lora_b.stride(1),
        SPLIT_K=split, BLOCK_M=tiling.block_m, BLOCK_N=tiling.block_n, BLOCK_S=block_s, BLOCK_K=tiling.block_k,
        IEEE=x.dtype == torch.float32, num_warps=tiling.num_warps,
    )
    return y


LORA_OPS = {"lora_shrink": lora_shrink, "lora_expand": lora_expand}
