"""The torch dequantizers of Q4_0 / Q4_1 / Q8_0 give exactly gguf.quants' values (the reference).

Random block bytes (every nibble and int8 value, negative, tiny and subnormal fp16 scales), the
real SmolLM2 file's tensors of each type, and rows of several blocks in multi-dimensional tensors.
"""

from __future__ import annotations

import gguf
import gguf.quants
import numpy as np
import pytest
import torch

from podium.loader import embedded_gguf_path
from podium.loader.gguf_quants import BLOCK_BYTES, dequantize_blocks
from podium.loader.gguf_reader import read_gguf

TYPES = {gguf.GGMLQuantizationType.Q4_0: 2, gguf.GGMLQuantizationType.Q4_1: 3, gguf.GGMLQuantizationType.Q8_0: 8}


def random_blocks(ggml_type: int, shape: tuple[int, ...], seed: int) -> np.ndarray:
    """uint8 [*shape[:-1], shape[-1] // 32 * block_bytes]: random payloads, finite fp16 scales of all sizes."""
    rng = np.random.default_rng(seed)
    block_bytes = BLOCK_BYTES[ggml_type]
    count = int(np.prod(shape)) // 32
    blocks = rng.integers(0, 256, size=(count, block_bytes), dtype=np.uint8)
    scales = (rng.standard_normal((count, 2)) * 10.0 ** rng.integers(-9, 3, size=(count, 2))).astype(np.float16)
    scales[::7] = np.float16(6e-8)  # subnormal
    scales[1::11] = -scales[1::11]
    head = 4 if ggml_type == 3 else 2
    blocks[:, :head] = scales.view(np.uint8)[:, :head]
    return blocks.reshape(*shape[:-1], shape[-1] // 32 * block_bytes)


@pytest.mark.parametrize("qtype", list(TYPES), ids=lambda t: t.name)
@pytest.mark.parametrize("shape", [(1, 32), (7, 96), (3, 5, 64)], ids=str)
def test_random_blocks_match_gguf_quants(qtype, shape):
    raw = random_blocks(TYPES[qtype], shape, seed=sum(shape))
    ours = dequantize_blocks(raw, TYPES[qtype])
    expected = torch.from_numpy(gguf.quants.dequantize(raw, qtype).astype(np.float32))
    assert ours.dtype == torch.float32 and ours.shape == shape
    assert torch.equal(ours, expected)


def test_smollm2_tensors_match_gguf_quants():
    file = read_gguf(embedded_gguf_path())
    seen = set()
    for info in file.tensors.values():
        if info.ggml_type in seen or info.ggml_type not in TYPES.values():
            continue
        seen.add(info.ggml_type)
        raw = file.raw(info)
        expected = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType(info.ggml_type))
        assert torch.equal(dequantize_blocks(raw, info.ggml_type), torch.from_numpy(expected)), info.name
    assert seen == {3, 8}  # SmolLM2's Q4_1 layers and Q8_0 embedding


def test_other_types_are_left_to_gguf():
    assert dequantize_blocks(np.zeros((1, 22), dtype=np.uint8), 6) is None  # Q5_0


def test_partial_block_row_is_an_error():
    with pytest.raises(ValueError, match="20-byte blocks"):
        dequantize_blocks(np.zeros((2, 30), dtype=np.uint8), 3)
