"""The batch-invariant GEMM's Hopper kernel: persistent programs, TMA loads (``out = x @ w^T + b``).

One program a multiprocessor; each walks the output tiles ``tile = pid, pid + programs, ...`` in a
grouped order (``GROUP_M`` row tiles of a column tile next to each other, so a weight tile read from
memory serves them all from L2). A tile's sum runs over K from 0 to K in BLOCK_K steps into one
float32 accumulator, the same instructions for every tile: which program takes a tile, and how many
tiles there are (M), change no bit of it. The operand tiles come in through tensor descriptors (the
copy engine, ``num_stages`` deep), which fill rows past M and columns past K with zeros, and the
output tile leaves through one, which writes no row past M. ``tma_ws`` warp-specializes the loop
(Triton's Hopper pass: a producer warp issues the copies, the other warps multiply).

The tile loop is flattened with the K loop (``flatten=True``) so the pipeliner keeps copies in flight
across a tile's end; the epilogue takes its tile from a counter of its own, so no value is shared
between the pipelined prologue and the epilogue.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from .gemm_plan import GemmTiling

try:
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # a Triton without host tensor descriptors (before 3.3): the pointer kernel runs
    TensorDescriptor = None

GROUP_M = 8  # row tiles per group of the tile order (L2 reuse of a weight tile)
TMA_DTYPES = (torch.bfloat16, torch.float16)
INTERPRETER_PROGRAMS = 3  # programs on the CPU interpreter: several tiles each, as on a GPU


@triton.jit
def _tile_coords(tile, tiles_m, tiles_n, GROUP_M: tl.constexpr):
    per_group = GROUP_M * tiles_n
    first_m = (tile // per_group) * GROUP_M
    rows_in_group = min(tiles_m - first_m, GROUP_M)
    return first_m + tile % rows_in_group, (tile % per_group) // rows_in_group


@triton.jit(do_not_specialize=["M"])
def _tma_gemm_kernel(x_desc, w_desc, out_desc, b_ptr, M, N, K, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr,
                     BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, PROGRAMS: tl.constexpr,
                     WARP_SPECIALIZE: tl.constexpr):
    tiles_m, tiles_n = tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N)
    k_steps = tl.cdiv(K, BLOCK_K)
    done = tl.program_id(0) - PROGRAMS  # the epilogue's own tile counter (module docstring)
    for tile in tl.range(tl.program_id(0), tiles_m * tiles_n, PROGRAMS, flatten=True,
                         warp_specialize=WARP_SPECIALIZE):
        pid_m, pid_n = _tile_coords(tile, tiles_m, tiles_n, GROUP_M)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for step in range(k_steps):  # the one fixed order of every element's sum
            x = x_desc.load([pid_m * BLOCK_M, step * BLOCK_K])  # [BM, BK]
            w = w_desc.load([pid_n * BLOCK_N, step * BLOCK_K])  # [BN, BK]
            acc = tl.dot(x, w.T, acc)
        done += PROGRAMS
        out_m, out_n = _tile_coords(done, tiles_m, tiles_n, GROUP_M)
        if HAS_BIAS:
            cols = out_n * BLOCK_N + tl.arange(0, BLOCK_N)
            acc += tl.load(b_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
        out_desc.store([out_m * BLOCK_M, out_n * BLOCK_N], acc.to(out_desc.dtype))


@functools.cache
def _device_programs(index: int) -> tuple[bool, int]:
    """(whether the device is a Hopper GPU, its multiprocessor count). Hopper only: the plans are
    measured there, and a tiling of 200+ KB of shared memory would not launch on a GPU with less
    (sm120 has ~100 KB); other GPUs run the pointer kernel."""
    props = torch.cuda.get_device_properties(index)
    return props.major == 9 and not getattr(torch.version, "hip", None), props.multi_processor_count


def tma_fits(n: int, k: int, dtype: torch.dtype, device: torch.device) -> bool:
    """Whether the TMA kernel takes a [n, k] weight of ``dtype`` on ``device``: a 16-bit dtype, rows of
    x, w and out that are whole 16-byte units (a descriptor's strides must be), a Hopper GPU (sm90) or
    Triton's CPU interpreter (which emulates descriptors). A function of (n, k, dtype, device) only,
    so the kernel a row meets never follows the batch."""
    if TensorDescriptor is None or dtype not in TMA_DTYPES or (n * dtype.itemsize) % 16 or (k * dtype.itemsize) % 16:
        return False
    return device.type == "cpu" or (device.type == "cuda" and _device_programs(device.index or 0)[0])


def _aligned(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself where a descriptor can address it (16-byte base and row stride, unit column
    stride), else a fresh copy (the allocator aligns it): the layout never picks the kernel."""
    if t.stride(-1) == 1 and t.data_ptr() % 16 == 0 and (t.stride(0) * t.element_size()) % 16 == 0:
        return t
    return t.contiguous() if not t.is_contiguous() else t.clone()


def tma_linear(rows: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor,
               t: GemmTiling):
    """``out [M, N] = rows [M, K] @ w [N, K]^T (+ bias)`` by the TMA kernel with tiling ``t``
    (``t.kernel`` "tma" or "tma_ws"); ``out`` contiguous, M > 0, ``tma_fits`` true. Returns the
    compiled kernel launched."""
    (m, k), n = rows.shape, w.shape[0]
    rows, w = _aligned(rows), _aligned(w)
    if rows.device.type == "cuda":
        programs = _device_programs(rows.device.index or 0)[1]
    else:
        programs = INTERPRETER_PROGRAMS
    tiles = triton.cdiv(m, t.block_m) * triton.cdiv(n, t.block_n)
    x_desc = TensorDescriptor(rows, [m, k], [rows.stride(0), 1], [t.block_m, t.block_k])
    w_desc = TensorDescriptor(w, [n, k], [w.stride(0), 1], [t.block_n, t.block_k])
    out_desc = TensorDescriptor(out, [m, n], [n, 1], [t.block_m, t.block_n])
    # PROGRAMS is the stride of every program's tile walk whatever M; only the grid shrinks when
    # there are fewer tiles than multiprocessors (the programs past the tiles would do nothing)
    return _tma_gemm_kernel[(min(programs, tiles),)](
        x_desc, w_desc, out_desc, bias if bias is not None else w, m, n, k, HAS_BIAS=bias is not None,
        BLOCK_M=t.block_m, BLOCK_N=t.block_n, BLOCK_K=t.block_k, GROUP_M=GROUP_M, PROGRAMS=programs,
        WARP_SPECIALIZE=t.kernel == "tma_ws", num_warps=t.num_warps, num_stages=t.num_stages)
