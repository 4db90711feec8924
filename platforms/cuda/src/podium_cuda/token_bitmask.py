"""Structured output's mask on the GPU: one launch that writes -inf over the forbidden tokens only.

The contract's reference (``podium_plugin_api.ops.apply_token_bitmask``) expands the int32 bitmask
through a byte table into a [rows, vocab] penalty and adds it: five launches and two passes over
the logits. Here a program takes ``BLOCK_WORDS`` words of one row, expands their 32 bits each in
registers and stores -inf where a bit is clear; allowed tokens are never read or written.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from podium_plugin_api import ops as reference

BLOCK_WORDS = 64  # 2,048 tokens a program: 24 programs a row of a 49k vocabulary


@triton.jit
def token_bitmask_kernel(logits_ptr, mask_ptr, rows_ptr, stride_row, words, vocab,
                         HAS_ROWS: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.program_id(0)
    if HAS_ROWS:
        row = tl.load(rows_ptr + i)
    else:
        row = i
    w = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)  # [BLOCK] word indices
    word = tl.load(mask_ptr + i * words + w, mask=w < words, other=-1)  # [BLOCK] int32; -1: all allowed
    bit = tl.arange(0, 32)
    forbidden = ((word[:, None] >> bit[None, :]) & 1) == 0  # [BLOCK, 32]
    token = w[:, None] * 32 + bit[None, :]  # [BLOCK, 32]
    neg_inf = tl.full([BLOCK, 32], float("-inf"), logits_ptr.dtype.element_ty)
    tl.store(logits_ptr + row.to(tl.int64) * stride_row + token, neg_inf, mask=forbidden & (token < vocab))


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor | None,
                        tuning=None) -> torch.Tensor:
    """The contract's ``apply_token_bitmask`` (same arguments, same result) in one launch."""
    words = triton.cdiv(logits.shape[-1], 32)
    if (logits.dim() != 2 or logits.stride(1) != 1 or bitmask.dtype != torch.int32 or bitmask.dim() != 2
            or bitmask.shape[1] != words or bitmask.device != logits.device):
        return reference.apply_token_bitmask(logits, bitmask, rows)
    count = bitmask.shape[0]
    if rows is None and count != logits.shape[0]:
        raise ValueError(f"apply_token_bitmask: {count} mask rows for {logits.shape[0]} logit rows and no row index")
    if count == 0:
        return logits
    bitmask = bitmask.contiguous()
    index = bitmask if rows is None else rows.to(device=logits.device, dtype=torch.int64).contiguous()
    grid = (count, triton.cdiv(words, BLOCK_WORDS))
    token_bitmask_kernel[grid](logits, bitmask, index, logits.stride(0), words, logits.shape[1],
                               HAS_ROWS=rows is not None, BLOCK=BLOCK_WORDS, num_warps=4)
    return logits
