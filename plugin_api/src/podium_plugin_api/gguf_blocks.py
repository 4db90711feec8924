"""ggml's block formats as the contract defines them: layouts, sizes and a pure-torch dequantizer.

A GGUF weight kept quantized is a uint8 tensor [rows, row_bytes]: each row is its own run of
blocks (so rows can be sliced, merged and permuted like float rows). A platform's kernel for
``gguf_linear`` / ``gguf_embedding`` reads exactly these bytes; ``dequantize_rows`` here is the
definition it is tested against (and what platforms without a kernel run). Little-endian; ``d``
and ``m`` are fp16; a nibble j of a 16-byte run holds weight j, its high nibble weight j + 16::

    Q8_0  32 weights, 34 B   [d][32 x int8 q]                            w = d * q
    Q4_0  32 weights, 18 B   [d][16 B nibbles]                           w = d * (q - 8)
    Q4_1  32 weights, 20 B   [d][m][16 B nibbles]                        w = d * q + m
    Q4_K 256 weights, 144 B  [d][dmin][12 B scales][128 B nibbles]       w = d * sc_j * q - dmin * m_j
    Q5_K 256 weights, 176 B  [d][dmin][12 B scales][32 B high bits][128 B nibbles]  (q gains bit 4)
    Q6_K 256 weights, 210 B  [128 B low nibbles][64 B 2-bit highs][16 x int8 scales][d]
                                                                          w = d * sc_j * (q - 32)

K-quants split a block into sub-blocks (8 of 32 for Q4_K/Q5_K with 6-bit scales and mins packed
in 12 bytes; 16 of 16 for Q6_K with int8 scales). Within each 64 (Q4_K/Q5_K) or 128 (Q6_K)
weights the low nibbles come first, then the high ones (``_k_nibbles``).
"""

from __future__ import annotations

import torch

Q4_0, Q4_1, Q8_0, Q4_K, Q5_K, Q6_K = 2, 3, 8, 12, 13, 14  # ggml type ids
NAMES = {Q4_0: "Q4_0", Q4_1: "Q4_1", Q8_0: "Q8_0", Q4_K: "Q4_K", Q5_K: "Q5_K", Q6_K: "Q6_K"}
# type id -> (weights per block, bytes per block)
BLOCKS = {Q4_0: (32, 18), Q4_1: (32, 20), Q8_0: (32, 34), Q4_K: (256, 144), Q5_K: (256, 176), Q6_K: (256, 210)}


def row_bytes(ggml_type: int, columns: int) -> int:
    """Bytes of one row of ``columns`` weights; ValueError for an unknown type or a partial block."""
    if ggml_type not in BLOCKS:
        raise ValueError(f"ggml type id {ggml_type} is not a kept-quantized format; kept: "
                         f"{', '.join(NAMES.values())}")
    weights, nbytes = BLOCKS[ggml_type]
    if columns % weights:
        raise ValueError(f"a {NAMES[ggml_type]} row holds whole blocks of {weights}; {columns} columns is not one")
    return columns // weights * nbytes


def _f16(blocks: torch.Tensor, start: int) -> torch.Tensor:
    """float32 [N, 1]: the fp16 at byte ``start`` of every block [N, block_bytes]."""
    return blocks[:, start:start + 2].contiguous().view(torch.float16).float()


def _nibbles(packed: torch.Tensor) -> torch.Tensor:
    """[N, 16] bytes -> int [N, 32]: low nibbles (weights 0-15), then high ones (16-31)."""
    return torch.cat((packed & 0x0F, packed >> 4), dim=-1)


def _k_nibbles(packed: torch.Tensor, span: int) -> torch.Tensor:
    """[N, B] bytes -> int [N, 2B]: each run of ``span`` bytes gives its low nibbles then its high ones."""
    runs = packed.reshape(packed.shape[0], -1, span)
    return torch.cat((runs & 0x0F, runs >> 4), dim=-1).reshape(packed.shape[0], -1)


def k_scales_mins(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K/Q5_K's 12 packed bytes [N, 12] -> 6-bit (scales, mins), int [N, 8] each."""
    s = scales.int()
    low, high = s[:, 0:4], s[:, 4:8]
    tail = s[:, 8:12]
    sc = torch.cat((low & 63, (tail & 0x0F) | ((low >> 6) << 4)), dim=-1)
    mn = torch.cat((high & 63, (tail >> 4) | ((high >> 6) << 4)), dim=-1)
    return sc, mn


def _dequantize_blocks(blocks: torch.Tensor, ggml_type: int) -> torch.Tensor:
    """uint8 [N, block_bytes] -> float32 [N, weights per block]."""
    if ggml_type == Q8_0:
        return _f16(blocks, 0) * blocks[:, 2:].contiguous().view(torch.int8).float()
    if ggml_type == Q4_0:
        return _f16(blocks, 0) * (_nibbles(blocks[:, 2:]).float() - 8.0)
    if ggml_type == Q4_1:
        return _f16(blocks, 0) * _nibbles(blocks[:, 4:]).float() + _f16(blocks, 2)
    if ggml_type in (Q4_K, Q5_K):
        d, dmin = _f16(blocks, 0), _f16(blocks, 2)
        sc, mn = k_scales_mins(blocks[:, 4:16])
        if ggml_type == Q4_K:
            q = _k_nibbles(blocks[:, 16:144], 32)  # [N, 256]
        else:
            q = _k_nibbles(blocks[:, 48:176], 32)
            bits = torch.arange(8, device=blocks.device)  # sub-block j takes bit j of each high byte
            high = (blocks[:, 16:48, None].int() >> bits) & 1  # [N, 32 (l), 8 (j)]
            q = q + (high.transpose(1, 2).reshape(-1, 256) << 4)
        q = q.reshape(-1, 8, 32).float()
        return (d[:, :, None] * sc[:, :, None] * q - dmin[:, :, None] * mn[:, :, None]).reshape(-1, 256)
    if ggml_type == Q6_K:
        low = _k_nibbles(blocks[:, 0:128], 64)  # [N, 256]: per half of 128, weights' low 4 bits
        qh = blocks[:, 128:192].int().reshape(-1, 2, 1, 32)  # [N, half, 1, l]
        shifts = torch.tensor([0, 2, 4, 6], device=blocks.device).reshape(1, 1, 4, 1)
        high = ((qh >> shifts) & 3).reshape(-1, 256)  # [N, half, quarter, l] -> quarter q of a half
        q = (low | (high << 4)) - 32
        scales = blocks[:, 192:208].contiguous().view(torch.int8).float()  # [N, 16], one per 16 weights
        d = _f16(blocks, 208)
        return (d[:, :, None] * scales[:, :, None] * q.reshape(-1, 16, 16).float()).reshape(-1, 256)
    raise ValueError(f"ggml type id {ggml_type} is not a kept-quantized format; kept: {', '.join(NAMES.values())}")


def dequantize_rows(raw: torch.Tensor, ggml_type: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """uint8 [*rows, row_bytes] -> [*rows, columns] in ``dtype`` (computed in float32)."""
    weights, nbytes = BLOCKS.get(ggml_type, (None, None))
    if weights is None:
        raise ValueError(f"ggml type id {ggml_type} is not a kept-quantized format; kept: {', '.join(NAMES.values())}")
    if raw.dtype != torch.uint8 or raw.shape[-1] % nbytes:
        raise ValueError(f"{NAMES[ggml_type]} rows must be uint8 whole blocks of {nbytes} bytes, got "
                         f"{raw.dtype} rows of {raw.shape[-1]}")
    columns = raw.shape[-1] // nbytes * weights
    values = _dequantize_blocks(raw.reshape(-1, nbytes), ggml_type)
    return values.reshape(*raw.shape[:-1], columns).to(dtype)


def gguf_linear(x: torch.Tensor, weight: torch.Tensor, ggml_type: int, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [T, K], weight uint8 [N, row_bytes] in ``ggml_type`` blocks -> x . w^T (+ bias) [T, N] in x's dtype.

    The reference dequantizes the whole weight and multiplies in float32 (float64 for float64 x), as
    the weights' own precision asks (a bf16 copy of a K-quant weight loses ~3 bits); kernels
    dequantize inside the matmul and never materialize it."""
    acc = torch.promote_types(x.dtype, torch.float32)
    out = torch.nn.functional.linear(x.to(acc), dequantize_rows(weight, ggml_type, acc),
                                     None if bias is None else bias.to(acc))
    return out.to(x.dtype)


def gguf_embedding(ids: torch.Tensor, weight: torch.Tensor, ggml_type: int, dtype: torch.dtype) -> torch.Tensor:
    """ids int [T], weight uint8 [V, row_bytes] -> the rows ``ids`` dequantized, [T, columns] in ``dtype``."""
    return dequantize_rows(weight.index_select(0, ids.reshape(-1)), ggml_type, dtype).reshape(*ids.shape, -1)


# where each format keeps its fp16 fields: (byte offset, typical magnitude) of d, then m / dmin
_HALF_FIELDS = {Q8_0: ((0, 0.01),), Q4_0: ((0, 0.02),), Q4_1: ((0, 0.02), (2, -0.1)),
                Q4_K: ((0, 0.004), (2, 0.01)), Q5_K: ((0, 0.002), (2, 0.01)), Q6_K: ((208, 0.0005),)}


def random_rows(ggml_type: int, rows: int, columns: int, generator: torch.Generator | None = None) -> torch.Tensor:
    """uint8 [rows, row_bytes]: random blocks of ``ggml_type`` whose fp16 scales are finite and small
    (weights of order 0.1), for tests of kernels against ``dequantize_rows``."""
    nbytes = row_bytes(ggml_type, columns)
    raw = torch.randint(0, 256, (rows, nbytes), dtype=torch.uint8, generator=generator)
    blocks = raw.view(-1, BLOCKS[ggml_type][1])
    for start, magnitude in _HALF_FIELDS[ggml_type]:
        values = (torch.rand(blocks.shape[0], generator=generator) + 0.5) * magnitude
        blocks[:, start:start + 2] = values.to(torch.float16).view(torch.uint8).reshape(-1, 2)
    return raw
