"""GGUF block formats kept quantized: the contract's dequantizer and every gguf_linear / gguf_embedding
the op table runs (the reference, and the selected platform's kernel) against gguf-py's ``dequantize``."""

from __future__ import annotations

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType  # noqa: E402
from gguf.quants import dequantize as gguf_dequantize  # noqa: E402

from podium_plugin_api.gguf_blocks import BLOCKS, NAMES, dequantize_rows, random_rows  # noqa: E402
from podium_plugin_api.ops import REFERENCE_OPS  # noqa: E402

TYPES = sorted(BLOCKS)


def reference(raw: torch.Tensor, ggml_type: int) -> torch.Tensor:
    """gguf-py's float32 dequantization of uint8 rows [N, row_bytes]."""
    values = gguf_dequantize(raw.numpy(), GGMLQuantizationType(ggml_type))
    return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32))


@pytest.mark.parametrize("ggml_type", TYPES, ids=[NAMES[t] for t in TYPES])
def test_dequantize_rows_equals_gguf_py(ggml_type):
    raw = random_rows(ggml_type, 24, 512, torch.Generator().manual_seed(ggml_type))
    torch.testing.assert_close(dequantize_rows(raw, ggml_type), reference(raw, ggml_type), rtol=0, atol=0)


def _platform_ops() -> dict:
    from podium_plugin_api import load_plugins
    from podium_plugin_api.ops import build_op_table

    platform = load_plugins().select("cpu").platform
    return build_op_table(platform.custom_ops())


@pytest.fixture(scope="module")
def cpu_ops():
    return _platform_ops()


@pytest.mark.parametrize("ggml_type", TYPES, ids=[NAMES[t] for t in TYPES])
@pytest.mark.parametrize("rows", [1, 3, 37])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("table", ["reference", "cpu"])
def test_gguf_linear_against_gguf_py(ggml_type, rows, dtype, table, cpu_ops):
    """x . dequantize(w)^T in float64 vs the op; a 512-wide, 72-row weight (not a multiple of any tile).
    The reference is float32 products; the CPU kernels quantize activations to int8 per 32 values (as
    llama.cpp does), so they are held to the format's tolerance, bf16's (their exact product:
    platforms/cpu/tests/test_cpu_gguf.py)."""
    gen = torch.Generator().manual_seed(100 * ggml_type + rows)
    weight = random_rows(ggml_type, 72, 512, gen)
    x = torch.randn(rows, 512, generator=gen).to(dtype)
    bias = torch.randn(72, generator=gen).to(dtype)
    op = (REFERENCE_OPS if table == "reference" else cpu_ops)["gguf_linear"]
    want = x.double() @ reference(weight, ggml_type).double().t() + bias.double()
    got = op(x, weight, ggml_type, bias)
    assert got.dtype == dtype and got.shape == (rows, 72)
    scale = want.abs().max().item()
    tol = 2e-2 if dtype == torch.bfloat16 or table == "cpu" else 1e-5  # bf16 rows: ~3 significant digits
    assert (got.double() - want).abs().max().item() <= tol * scale


@pytest.mark.parametrize("ggml_type", TYPES, ids=[NAMES[t] for t in TYPES])
@pytest.mark.parametrize("table", ["reference", "cpu"])
def test_gguf_embedding_against_gguf_py(ggml_type, table, cpu_ops):
    gen = torch.Generator().manual_seed(ggml_type)
    weight = random_rows(ggml_type, 50, 256, gen)
    ids = torch.tensor([3, 0, 49, 3, 17])
    op = (REFERENCE_OPS if table == "reference" else cpu_ops)["gguf_embedding"]
    got = op(ids, weight, ggml_type, torch.float32)
    torch.testing.assert_close(got, reference(weight, ggml_type)[ids], rtol=0, atol=0)


def test_a_row_of_partial_blocks_is_refused():
    with pytest.raises(ValueError, match="whole blocks of 20 bytes"):
        dequantize_rows(torch.zeros(2, 30, dtype=torch.uint8), 3)
    with pytest.raises(ValueError, match="not a kept-quantized format"):
        dequantize_rows(torch.zeros(2, 30, dtype=torch.uint8), 10)
