"""Dequantizing ggml's legacy block formats (Q4_0, Q4_1, Q8_0) in torch, bit-exact with ``gguf.quants``.

Why: ``gguf.quants`` walks the blocks in numpy over groups of 16 rows; for SmolLM2's Q8_0
embedding and Q4_1 layers that was ~1.5 s of a ~5 s startup. Here each tensor is a handful of
vectorised torch ops (~0.1 s for the whole model). The arithmetic is the same float32 ops in the
same order (fp16 scale widened, one multiply, then one add), so the values are identical; other
formats go to ``gguf.quants``.

Block layouts (32 weights each, little-endian; nibble j holds weight j, the high nibble weight j+16)::

    Q8_0  [fp16 d][32 x int8 q]                 w = q * d
    Q4_0  [fp16 d][16 bytes: 32 nibbles]         w = (nibble - 8) * d
    Q4_1  [fp16 d][fp16 m][16 bytes: 32 nibbles] w = nibble * d + m
"""

from __future__ import annotations

import numpy as np
import torch

BLOCK = 32
Q4_0, Q4_1, Q8_0 = 2, 3, 8  # ggml type ids
BLOCK_BYTES = {Q4_0: 18, Q4_1: 20, Q8_0: 34}


def _half(blocks: torch.Tensor, start: int) -> torch.Tensor:
    """float32 [N, 1, 1]: the fp16 stored at byte ``start`` of every block."""
    return blocks[:, start:start + 2].contiguous().view(torch.float16).float()[:, :, None]


def _nibbles(packed: torch.Tensor) -> torch.Tensor:
    """float32 [N, 2, 16] from [N, 16] packed bytes: low nibbles are weights 0-15, high ones 16-31."""
    out = torch.empty(packed.shape[0], 2, BLOCK // 2)
    out[:, 0] = packed & 0x0F
    out[:, 1] = packed >> 4
    return out


def dequantize_blocks(raw: np.ndarray, ggml_type: int) -> torch.Tensor | None:
    """float32 [*raw.shape[:-1], weights per row] from uint8 rows of blocks; None for other types."""
    block_bytes = BLOCK_BYTES.get(ggml_type)
    if block_bytes is None:
        return None
    if raw.shape[-1] % block_bytes:
        raise ValueError(f"a row of {raw.shape[-1]} bytes is not a whole number of {block_bytes}-byte blocks")
    blocks = torch.from_numpy(np.array(raw, dtype=np.uint8)).reshape(-1, block_bytes)  # [N, block_bytes]
    scale = _half(blocks, 0)  # [N, 1, 1]
    if ggml_type == Q8_0:
        weights = torch.empty(blocks.shape[0], 1, BLOCK)
        weights[:, 0] = blocks[:, 2:].view(torch.int8)
        weights.mul_(scale)
    elif ggml_type == Q4_0:
        weights = _nibbles(blocks[:, 2:]).sub_(8.0).mul_(scale)
    else:
        weights = _nibbles(blocks[:, 4:]).mul_(scale).add_(_half(blocks, 2))
    return weights.reshape(*raw.shape[:-1], raw.shape[-1] // block_bytes * BLOCK)
