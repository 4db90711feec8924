"""A GEMM for decode batches, ``y = x @ w.T``, spread evenly over every multiprocessor.

x [M, K] activations (M: a decode batch, about 64..512 rows), w [N, K] weights in nn.Linear layout,
y [M, N]; bf16 or fp16 operands, float32 accumulation. ``gemm_silu_mul`` is the gate_up projection
with the activation fused into its epilogue: w = [gate; up] [2I, K] (gate rows [0, I), up rows
[I, 2I)), each tile accumulates a gate tile and the matching up tile and writes silu(gate) * up
[M, I], so the [M, 2I] intermediate never reaches memory. With ``paired=True`` the weight's rows
are interleaved once at load time (``pair_gate_up``: gate j, up j, gate j+1, ...), so a tile is one
dot over BN rows whose column pairs are (gate, up) of BN / 2 outputs.

Why not one tile a program: at M = 256 Llama-8B's gate_up has 224 output tiles of 128 x 256 for 132
multiprocessors, so the second wave runs 92 tiles and 40 multiprocessors idle (wave quantization).
The schedule here is a persistent grid of one program a multiprocessor, in two phases:

    tiles (n-major: the row tiles sharing one weight tile are neighbours, so it is read once from HBM)
    | data-parallel: whole tiles, round robin        | stream-K: the rest, cut by K iteration     |
    | t0 t1 ... (dp_tiles = full waves of programs)  | p0 [....] p1 [....] ... p131 [....]        |

In the stream-K phase every program gets an equal run of (tile, k-step) iterations; a run may
start or end inside a tile. A program that holds only part of a tile stores its float32 partial
sum in a workspace slot (2 slots a program: the tile it starts in, the tile it ends in), then
increments the tile's counter; whoever arrives last adds the pieces in program order (so the
result does not depend on arrival order), writes the tile and resets the counter to zero. Nothing
waits on another program, so the schedule cannot deadlock and runs under the interpreter, which
runs programs one after another.

CUDA graphs: no host sync, no allocation per call. The workspace and counters are allocated once
per device and tiling (``_scratch``), zero at allocation and left zero by every launch; make the
first call for a device outside graph capture (warm-up). Launches that share them must be ordered
(one stream), which the decode step is.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from .tuning import GemmTiling

MAX_COUNTERS = 1 << 16  # stream-K tiles one launch may split (a counter each)
DEFAULT_TILING = GemmTiling()


@triton.jit
def _owner(it, total, programs):
    """The program whose stream-K run holds iteration ``it`` (run p is [p*total//P, (p+1)*total//P))."""
    return ((it + 1) * programs + total - 1) // total - 1


@triton.jit
def _slot(p, tile, k_iters, total, programs):
    """Workspace slot of program p's partial sum of ``tile``: 0 for the tile its run starts in, else 1."""
    return tl.where((p * total // programs) // k_iters == tile, 0, 1)


PLAIN, HALVES, PAIRED = 0, 1, 2  # what a tile computes (the GATE constexpr), see _accumulate


@triton.jit
def _accumulate(x_src, w_src, off_m, off_n, up_row, k_lo, k_hi, M, N, K, stride_xm, stride_wn,
                BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                GATE: tl.constexpr, TMA: tl.constexpr, WS: tl.constexpr, EVEN_K: tl.constexpr):
    """Sums k-steps [k_lo, k_hi) of one tile: acc = x @ w[off_n : off_n + BN].T [BM, BN], and for
    GATE == HALVES also acc_up = x @ w[up_row + off_n :][:BN].T (PLAIN and PAIRED: acc_up unused).
    N is the number of weight rows the tiles cover (rows past it are never stored)."""
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    acc_up = tl.zeros((BM, BN), dtype=tl.float32)
    if TMA:  # descriptors: out-of-bounds rows and columns read as zeros
        for ki in tl.range(k_lo, k_hi, warp_specialize=WS):
            k = ki * BK
            a = x_src.load([off_m, k])
            acc = tl.dot(a, w_src.load([off_n, k]).T, acc)
            if GATE == 1:
                acc_up = tl.dot(a, w_src.load([up_row + off_n, k]).T, acc_up)
    else:
        # rows past M / N re-read valid rows (never stored), so only K needs a mask
        rm = (off_m + tl.arange(0, BM)) % M
        rn = ((off_n + tl.arange(0, BN)) % N).to(tl.int64)
        rk = k_lo * BK + tl.arange(0, BK)
        x_ptrs = x_src + rm[:, None] * stride_xm + rk[None, :]
        w_ptrs = w_src + rn[:, None] * stride_wn + rk[None, :]
        u_ptrs = w_ptrs + up_row * stride_wn
        for ki in tl.range(k_lo, k_hi):
            k_ok = (ki * BK + tl.arange(0, BK))[None, :] < K
            if EVEN_K:
                a = tl.load(x_ptrs)
                b = tl.load(w_ptrs)
            else:
                a = tl.load(x_ptrs, mask=k_ok, other=0.0)
                b = tl.load(w_ptrs, mask=k_ok, other=0.0)
            acc = tl.dot(a, tl.trans(b), acc)
            if GATE == 1:
                if EVEN_K:
                    u = tl.load(u_ptrs)
                else:
                    u = tl.load(u_ptrs, mask=k_ok, other=0.0)
                acc_up = tl.dot(a, tl.trans(u), acc_up)
                u_ptrs += BK
            x_ptrs += BK
            w_ptrs += BK
    return acc, acc_up


@triton.jit
def _store_tile(y_ptr, acc, acc_up, off_m, off_n, M, out_cols, stride_ym,
                BM: tl.constexpr, BN: tl.constexpr, GATE: tl.constexpr):
    """Writes one output tile. Gated tiles round gate and up like the unfused path (GEMM output in
    y's dtype, then silu(gate) rounded, times up). PAIRED: the tile's BN weight rows alternate gate
    and up rows, so acc's column pairs are (gate, up) of BN // 2 outputs."""
    dtype = y_ptr.dtype.element_ty
    if GATE == 2:
        gate, up = tl.split(tl.reshape(acc, (BM, BN // 2, 2)))
        cols = off_n // 2 + tl.arange(0, BN // 2)
    else:
        gate = acc
        up = acc_up
        cols = off_n + tl.arange(0, BN)
    if GATE == 0:
        out = acc.to(dtype)
    else:
        g = gate.to(dtype).to(tl.float32)
        silu = (g / (1.0 + tl.exp(-g))).to(dtype).to(tl.float32)
        out = (silu * up.to(dtype).to(tl.float32)).to(dtype)
    rows = off_m + tl.arange(0, BM)
    tl.store(y_ptr + rows[:, None] * stride_ym + cols[None, :], out,
             mask=(rows < M)[:, None] & (cols < out_cols)[None, :])


@triton.jit
def _finish_split_tile(y_ptr, ws_ptr, lock_ptr, acc, acc_up, pid, tile, sk_tile, off_m, off_n, M, out_cols,
                       stride_ym, k_iters, total, programs,
                       BM: tl.constexpr, BN: tl.constexpr, GATE: tl.constexpr):
    """Stores this program's partial sum of a split tile; the last of the tile's programs to arrive
    adds all of them in program order, writes the tile and resets its counter."""
    NACC: tl.constexpr = 2 if GATE == 1 else 1
    cells = tl.arange(0, BM)[:, None] * BN + tl.arange(0, BN)[None, :]
    mine = ws_ptr + (pid * 2 + _slot(pid, sk_tile, k_iters, total, programs)) * (NACC * BM * BN)
    tl.store(mine + cells, acc)
    if GATE == 1:
        tl.store(mine + BM * BN + cells, acc_up)
    tl.debug_barrier()  # every thread's partial is written before the counter moves
    first = _owner(sk_tile * k_iters, total, programs)
    last = _owner(sk_tile * k_iters + k_iters - 1, total, programs)
    arrived = tl.atomic_add(lock_ptr + tile, 1, sem="acq_rel")
    if arrived == last - first:
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        acc_up = tl.zeros((BM, BN), dtype=tl.float32)
        for p in range(first, last + 1):
            piece = ws_ptr + (p * 2 + _slot(p, sk_tile, k_iters, total, programs)) * (NACC * BM * BN)
            acc += tl.load(piece + cells, cache_modifier=".cg")
            if GATE == 1:
                acc_up += tl.load(piece + BM * BN + cells, cache_modifier=".cg")
        _store_tile(y_ptr, acc, acc_up, off_m, off_n, M, out_cols, stride_ym, BM, BN, GATE)
        tl.atomic_xchg(lock_ptr + tile, 0)


@triton.jit(do_not_specialize=["M", "N", "K", "out_cols", "up_row", "dp_tiles"])  # one build for every decode shape
def gemm_kernel(x_src, w_src, y_ptr, ws_ptr, lock_ptr, M, N, K, out_cols, up_row, stride_xm, stride_wn, stride_ym,
                dp_tiles,
                BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                GATE: tl.constexpr, TMA: tl.constexpr, WS: tl.constexpr, EVEN_K: tl.constexpr):
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    num_m = tl.cdiv(M, BM)
    tiles = num_m * tl.cdiv(N, BN)
    k_iters = tl.cdiv(K, BK)
    for tile in range(pid, dp_tiles, programs):  # data-parallel phase: whole tiles
        off_m = (tile % num_m) * BM
        off_n = (tile // num_m) * BN
        acc, acc_up = _accumulate(x_src, w_src, off_m, off_n, up_row, 0, k_iters, M, N, K, stride_xm, stride_wn,
                                  BM, BN, BK, GATE, TMA, WS, EVEN_K)
        _store_tile(y_ptr, acc, acc_up, off_m, off_n, M, out_cols, stride_ym, BM, BN, GATE)
    # stream-K phase: program pid runs k-steps [start, end) of the remaining tiles (end > start:
    # plan_schedule gives every program at least one), a for loop so the k-loop inside is pipelined
    total = (tiles - dp_tiles) * k_iters
    start = pid * total // programs
    end = (pid + 1) * total // programs
    for sk_tile in range(start // k_iters, (end + k_iters - 1) // k_iters):
        k_lo = tl.maximum(start - sk_tile * k_iters, 0)
        k_hi = tl.minimum(end - sk_tile * k_iters, k_iters)
        tile = dp_tiles + sk_tile
        off_m = (tile % num_m) * BM
        off_n = (tile // num_m) * BN
        acc, acc_up = _accumulate(x_src, w_src, off_m, off_n, up_row, k_lo, k_hi, M, N, K, stride_xm, stride_wn,
                                  BM, BN, BK, GATE, TMA, WS, EVEN_K)
        if k_lo == 0 and k_hi == k_iters:
            _store_tile(y_ptr, acc, acc_up, off_m, off_n, M, out_cols, stride_ym, BM, BN, GATE)
        else:
            _finish_split_tile(y_ptr, ws_ptr, lock_ptr, acc, acc_up, pid, tile, sk_tile, off_m, off_n, M, out_cols,
                               stride_ym, k_iters, total, programs, BM, BN, GATE)


@functools.cache
def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 4  # the interpreter: a few programs, so tests exercise the stream-K hand-off
    return torch.cuda.get_device_properties(device).multi_processor_count


_SCRATCH: dict = {}


def _scratch(device: torch.device, programs: int, tiling: GemmTiling, accumulators: int):
    """(workspace, counters) for one device and tile shape: allocated once, left zeroed by every launch."""
    key = (device, programs, tiling.block_m, tiling.block_n, accumulators)
    if key not in _SCRATCH:
        cells = programs * 2 * accumulators * tiling.block_m * tiling.block_n
        counters = _SCRATCH.setdefault(("counters", device), torch.zeros(MAX_COUNTERS, dtype=torch.int32, device=device))
        _SCRATCH[key] = (torch.empty(cells, dtype=torch.float32, device=device), counters)
    return _SCRATCH[key]


def plan_schedule(tiles: int, k_iters: int, programs: int, stream_k_waves: int) -> tuple[int, int]:
    """(programs to launch, tiles done whole) for a persistent grid of at most ``programs``.

    Whole tiles fill full waves; ``stream_k_waves`` of the last waves (the partial one counts) are
    shared out by k-step. Stream-K needs at least one k-step a program, else every tile is whole.
    """
    if tiles <= programs and stream_k_waves == 0:
        return tiles, tiles
    waves_whole = tiles // programs
    if stream_k_waves == -1:
        dp_waves = 0
    else:
        dp_waves = max(0, waves_whole + (tiles % programs > 0) - stream_k_waves)
    dp_tiles = min(tiles, dp_waves * programs)
    if dp_tiles == tiles or (tiles - dp_tiles) * k_iters < programs:
        return min(tiles, programs), tiles
    return programs, dp_tiles


def _check(x: torch.Tensor, w: torch.Tensor, out_cols: int, out: torch.Tensor | None, what: str) -> torch.Tensor:
    if x.dim() != 2 or w.dim() != 2 or x.shape[1] != w.shape[1]:
        raise ValueError(f"{what}: x {tuple(x.shape)} and w {tuple(w.shape)} must be [M, K] and [N, K]")
    if x.dtype != w.dtype or x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"{what}: x {x.dtype} and w {w.dtype} must share one of bf16, fp16, fp32")
    if x.stride(1) != 1 or w.stride(1) != 1:
        raise ValueError(f"{what}: x and w need a contiguous last dimension (call .contiguous())")
    shape = (x.shape[0], out_cols)
    if out is None:
        return torch.empty(shape, dtype=x.dtype, device=x.device)
    if tuple(out.shape) != shape or out.dtype != x.dtype or out.stride(1) != 1:
        raise ValueError(f"{what}: out {tuple(out.shape)} {out.dtype} must be {shape} {x.dtype}, last dim contiguous")
    return out


def _tma_ok(x: torch.Tensor, w: torch.Tensor) -> bool:
    return all(t.data_ptr() % 16 == 0 and (t.stride(0) * t.element_size()) % 16 == 0 for t in (x, w))


def _launch(x, w, y, rows: int, up_row: int, gate: int, tiling: GemmTiling) -> torch.Tensor:
    """Tiles cover ``rows`` weight rows (PLAIN: N, HALVES: the gate rows, PAIRED: all 2I)."""
    M, K = x.shape
    if M == 0:
        return y
    bm, bn, bk = tiling.block_m, tiling.block_n, tiling.block_k
    tiles = triton.cdiv(M, bm) * triton.cdiv(rows, bn)
    k_iters = triton.cdiv(K, bk)
    programs, dp_tiles = plan_schedule(tiles, k_iters, _sm_count(x.device), tiling.stream_k_waves)
    if tiles > MAX_COUNTERS or tiles * k_iters * programs >= 2**31:
        raise ValueError(f"gemm: {tiles} tiles of {bm}x{bn} over K={K} is too large for this decode GEMM")
    ws, counters = _scratch(x.device, programs, tiling, 2 if gate == HALVES else 1)
    tma = tiling.loader == "tma" and _tma_ok(x, w)
    if tma:
        from triton.tools.tensor_descriptor import TensorDescriptor

        x_src = TensorDescriptor(x, list(x.shape), [x.stride(0), 1], [bm, bk])
        w_src = TensorDescriptor(w, list(w.shape), [w.stride(0), 1], [bn, bk])
    else:
        x_src, w_src = x, w
    gemm_kernel[(programs,)](
        x_src, w_src, y, ws, counters, M, rows, K, y.shape[1], up_row, x.stride(0), w.stride(0), y.stride(0), dp_tiles,
        BM=bm, BN=bn, BK=bk, GATE=gate, TMA=tma, WS=tma and tiling.warp_specialize, EVEN_K=K % bk == 0,
        num_warps=tiling.num_warps, num_stages=tiling.num_stages,
    )
    return y


def gemm(x: torch.Tensor, w: torch.Tensor, tiling: GemmTiling = DEFAULT_TILING,
         out: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] @ w[N, K].T -> [M, N] in x's dtype (float32 accumulation)."""
    y = _check(x, w, w.shape[0], out, "gemm")
    return _launch(x, w, y, w.shape[0], 0, PLAIN, tiling)


def gemm_silu_mul(x: torch.Tensor, w_gate_up: torch.Tensor, tiling: GemmTiling = DEFAULT_TILING,
                  out: torch.Tensor | None = None, paired: bool = False) -> torch.Tensor:
    """silu(x @ gate.T) * (x @ up.T) [M, I] for w_gate_up = [gate; up] [2I, K], or, with
    ``paired``, for the rows interleaved by ``pair_gate_up`` (gate row j at 2j, up row j at 2j + 1:
    one dot a tile, its column pairs split in registers)."""
    if w_gate_up.shape[0] % 2:
        raise ValueError(f"gemm_silu_mul: w_gate_up has {w_gate_up.shape[0]} rows; [gate; up] needs an even count")
    inter = w_gate_up.shape[0] // 2
    y = _check(x, w_gate_up, inter, out, "gemm_silu_mul")
    if paired:
        if tiling.block_n < 32:
            raise ValueError("gemm_silu_mul(paired=True) needs block_n >= 32 (block_n // 2 outputs a tile)")
        return _launch(x, w_gate_up, y, 2 * inter, 0, PAIRED, tiling)
    return _launch(x, w_gate_up, y, inter, inter, HALVES, tiling)


def pair_gate_up(w_gate_up: torch.Tensor) -> torch.Tensor:
    """[gate; up] [2I, K] -> rows interleaved (gate 0, up 0, gate 1, up 1, ...) for ``paired=True``."""
    two_i, k = w_gate_up.shape
    return w_gate_up.view(2, two_i // 2, k).transpose(0, 1).reshape(two_i, k).contiguous()
