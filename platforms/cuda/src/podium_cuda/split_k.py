"""Split-K bookkeeping shared by the GEMVs that split K over programs (awq_gemv.py, int4_gemv.py,
fp8_gemv.py): each program stores its float32 partial sums, then counts itself in with one atomic
on its column block's counter; the program that brings the count to ``splits`` adds the partial
sums in split order (deterministic) and writes the output, then puts the counter back to zero, so
the counters are zero between launches and need no memset (a captured graph replays the same).

The counters are one zeroed int32 tensor per device and stream, allocated on first use (before a
graph is captured: the runner's warm-up call comes first) and reused by every launch on that stream;
launches on one stream run one after the other (a PDL launch waits for its predecessor before it
touches memory), so no two launches count on the same counter at once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_COUNTERS: dict = {}  # (device, stream) -> int32 counters


def counters(device: torch.device, blocks: int) -> torch.Tensor:
    """At least ``blocks`` zeroed int32 counters for launches on ``device``'s current stream."""
    stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0
    key = (device, stream)
    counts = _COUNTERS.get(key)
    if counts is None or counts.numel() < blocks:
        counts = torch.zeros(max(blocks, 4096), dtype=torch.int32, device=device)
        _COUNTERS[key] = counts
    return counts


@triton.jit
def last_split(count_ptr, block, splits):
    """Whether this program is the last of ``splits`` of its column block to finish (call after storing
    its partial sums; the barrier orders every thread's stores before the count's release). Its
    caller resets the count with ``reset``."""
    tl.debug_barrier()
    last = splits == 1
    if splits > 1:
        last = tl.atomic_add(count_ptr + block, 1, sem="acq_rel") == splits - 1
    return last


@triton.jit
def reset(count_ptr, block, splits):
    if splits > 1:
        tl.atomic_xchg(count_ptr + block, 0)


@triton.jit
def finish_row(out_ptr, partial_ptr, b_ptr, n0, N, splits, BLOCK_N: tl.constexpr, HAS_BIAS: tl.constexpr):
    """out[n0 : n0 + BLOCK_N] = sum over splits of partial[split, ...] (+ bias): one row, partial float32
    [splits, N]."""
    cols = n0 + tl.arange(0, BLOCK_N)
    ok = cols < N
    total = tl.zeros([BLOCK_N], dtype=tl.float32)
    for other in range(0, splits):
        total += tl.load(partial_ptr + other * N + cols, mask=ok, other=0.0, cache_modifier=".cg")
    if HAS_BIAS:
        total += tl.load(b_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + cols, total.to(out_ptr.dtype.element_ty), mask=ok)
