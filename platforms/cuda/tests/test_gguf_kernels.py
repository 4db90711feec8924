"""The Triton GGUF kernels (``podium_cuda.gguf``) against gguf-py's ``dequantize``: every kept block
format, 1 / 5 / 37 rows, with and without a bias; the embedding row for row. Under
``TRITON_INTERPRET=1`` (no GPU) float32 only; on the GPU bf16 too (its tile rounds to bf16)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from podium_plugin_api.gguf_blocks import BLOCKS, NAMES, random_rows

gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType  # noqa: E402
from gguf.quants import dequantize as gguf_dequantize  # noqa: E402

pytestmark = pytest.mark.cuda
TYPES = sorted(BLOCKS)


def reference(raw: torch.Tensor, ggml_type: int) -> torch.Tensor:
    values = gguf_dequantize(raw.numpy(), GGMLQuantizationType(ggml_type))
    return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float64))


@pytest.mark.parametrize("ggml_type", TYPES, ids=[NAMES[t] for t in TYPES])
@pytest.mark.parametrize("rows", [1, 5, 37])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gguf_linear_kernel(ggml_type, rows, dtype, kernel_device, check_dtype):
    check_dtype(dtype)
    from podium_cuda.gguf import gguf_linear

    gen = torch.Generator().manual_seed(10 * ggml_type + rows)
    weight = random_rows(ggml_type, 72, 512, gen)  # 72 outputs: a partial 64-wide tile
    x = torch.randn(rows, 512, generator=gen)
    bias = torch.randn(72, generator=gen) if rows != 5 else None
    want = x.double() @ reference(weight, ggml_type).t() + (0 if bias is None else bias.double())
    got = gguf_linear(x.to(kernel_device, dtype), weight.to(kernel_device), ggml_type,
                      None if bias is None else bias.to(kernel_device, dtype))
    assert got.dtype == dtype and got.shape == (rows, 72)
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
    assert (got.double().cpu() - want).abs().max().item() <= tol * want.abs().max().item()


@pytest.mark.parametrize("ggml_type", TYPES, ids=[NAMES[t] for t in TYPES])
def test_gguf_embedding_kernel(ggml_type, kernel_device):
    from podium_cuda.gguf import gguf_embedding

    weight = random_rows(ggml_type, 40, 256, torch.Generator().manual_seed(ggml_type))
    ids = torch.tensor([7, 0, 39, 7])
    got = gguf_embedding(ids.to(kernel_device), weight.to(kernel_device), ggml_type, torch.float32)
    torch.testing.assert_close(got.cpu().double(), reference(weight, ggml_type)[ids], rtol=0, atol=0)
