"""One copy of each weight: a native linear keeps only its packed weight (a kernel with a row limit
hands larger batches to oneDNN on a copy unpacked from its tiles for the call), ``unpacked()`` gives
the plain one back exactly, and a tied embedding reads its rows from the head's packed weight
(``PanelEmbedding``) instead of holding a second table."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from podium_cpu import linear_packing
from podium_cpu.embedding import native_embeddings
from podium_cpu.linear_choice import LinearRule, runnable_native_kernels
from podium_cpu.linear_packing import (
    NativeLinear,
    PanelEmbedding,
    amx_tiles,
    f32_panels,
    fma_panels,
    pack_linear_layers,
    unpacked_weight,
)
from podium_cpu.platform import CpuPlatform
from podium_plugin_api import resolve_options

BITS = {torch.bfloat16: torch.int16, torch.float32: torch.int32}



@pytest.fixture(params=["amx-bfloat16", "avx512-bf16-bfloat16", "fma-bfloat16", "fma-float32"])
def packed_only(request, kernels):
    """Each native kernel this CPU runs, given every batch: its layers keep only the packed weight."""
    found = {f"{k.name}-{str(k.dtype).removeprefix('torch.')}": k for k in runnable_native_kernels(kernels)}
    if request.param not in found:
        pytest.skip(f"the {request.param} linear kernel does not run on this CPU")
    return dataclasses.replace(found[request.param], max_rows=None)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(BITS[a.dtype]), b.view(BITS[b.dtype]))


def weights(shape: tuple[int, int], dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """Random values with signed zeros, infinities and a NaN among them: an inverse must keep every bit."""
    w = torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(dtype)
    flat = w.view(-1)
    for i, value in enumerate((-0.0, float("inf"), float("-inf"), float("nan"))):
        flat[(i * 7919) % flat.numel()] = value
    return w


@pytest.mark.parametrize("shape", [(960, 576), (100, 70), (33, 64), (16, 31), (1, 1), (72, 7)])
@pytest.mark.parametrize("layout,dtype", [(amx_tiles, torch.bfloat16), (fma_panels, torch.bfloat16),
                                          (f32_panels, torch.float32)], ids=["amx_tiles", "fma_panels", "f32_panels"])
def test_unpacked_inverts_each_layout_exactly(layout, dtype, shape):
    w = weights(shape, dtype)
    assert same_bits(unpacked_weight(layout, layout(w), *shape), w)


UNPACKS = [(amx_tiles, torch.bfloat16, "tile_unpack"), (f32_panels, torch.float32, "panel_unpack")]


@pytest.mark.parametrize("layout,dtype,entry", UNPACKS, ids=["amx_tiles", "f32_panels"])
@pytest.mark.parametrize("shape", [(960, 576), (100, 70), (33, 64), (16, 31), (1, 1), (72, 7), (40, 96)])
def test_native_unpack_rebuilds_any_rows_of_the_plain_weight_exactly(kernels, layout, dtype, entry, shape):
    """fused_ops.c's unpacks (AVX-512's in-register transposes, or the scalar loops) against the
    weight the layout packed, for row ranges from any 16-row block, into rows wider than the weight."""
    n, k = shape
    w = weights(shape, dtype, seed=4)
    packed = layout(w)
    unpack = getattr(kernels, entry)[dtype]
    for n0, n1 in {(0, n), (16 * (n // 32), n), (0, (n + 1) // 2), (16, min(n, 48)), (0, 0)}:
        if n0 > n1:
            continue
        out = torch.full((n1 - n0, k + 3), 7.0, dtype=dtype)  # ld = k + 3: the gap keeps its 7s
        assert unpack(packed.data_ptr(), n, k, n0, n1, out.data_ptr(), k + 3, 2) == 0
        assert same_bits(out[:, :k].contiguous(), w[n0:n1]) and bool((out[:, k:] == 7).all()), (n0, n1)
    out = torch.empty(n, k, dtype=dtype)
    for bad in ((8, n), (0, n + 1), (-16, n)):  # n0 off a 16-row block, past the weight, negative
        assert unpack(packed.data_ptr(), n, k, *bad, out.data_ptr(), k, 2) == -1


@pytest.fixture(params=["amx_tiles", "f32_panels"])
def row_limited(kernels, request):
    """A native kernel with a row limit and its layout's unpack: AMX's rule on its tiles (on a CPU with
    AVX512-BF16 and no AMX its kernel stands in, the same layout and the same path above it), and
    float32 FMA's on an AMX CPU."""
    layout, dtype, entry = next(u for u in UNPACKS if u[0].__name__ == request.param)
    found = [k for k in runnable_native_kernels(kernels) if k.layout is layout and k.dtype == dtype]
    if not found:
        pytest.skip(f"no native kernel reads {request.param} on this CPU")
    return dataclasses.replace(found[0], max_rows=16, unpack=getattr(kernels, entry)[dtype])


@pytest.mark.parametrize("bias", [False, True])
def test_a_row_limited_layer_keeps_one_copy_and_gives_onednn_the_unpacked_weight(row_limited, bias):
    dtype = row_limited.dtype
    linear = nn.Linear(576, 960, bias=bias).to(dtype).requires_grad_(False)
    linear.weight.copy_(weights((960, 576), dtype, seed=5).nan_to_num(0.0, 1.0, -1.0))
    layer = NativeLinear(linear, row_limited, keep_weight=False)
    assert not layer.keeps_weight and "weight" not in layer.state_dict()
    other = torch.float32 if dtype == torch.bfloat16 else torch.bfloat16
    for rows in (17, 300):  # above the kernel's rows: F.linear on the unpacked weight, bit for bit
        x = torch.randn(rows, 576, generator=torch.Generator().manual_seed(rows)).to(dtype)
        assert same_bits(layer(x), F.linear(x, linear.weight, linear.bias))
        assert same_bits(layer(x.view(1, rows, 576)), F.linear(x, linear.weight, linear.bias).view(1, rows, 960))
        cast = x.to(other)  # cast to the kernel's dtype, as below its rows
        assert same_bits(layer(cast), F.linear(cast.to(dtype), linear.weight, linear.bias).to(other))
    assert not layer(torch.empty(0, 576, dtype=dtype)).numel()
    with pytest.raises(ValueError, match="row limit|no unpack"):
        NativeLinear(linear, dataclasses.replace(row_limited, unpack=None), keep_weight=False)


def test_a_weight_larger_than_the_scratch_is_unpacked_a_slice_of_rows_at_a_time(row_limited, monkeypatch):
    """The LM head above the kernel's rows (prompt logprobs): slices of rows through the scratch,
    each slice's columns of the output from oneDNN, so every element is one rounding of exact sums."""
    dtype = row_limited.dtype
    size = torch.tensor([], dtype=dtype).element_size()
    monkeypatch.setattr(linear_packing, "UNPACK_SCRATCH_BYTES", 100 * 64 * size)  # 96 rows a slice
    linear = nn.Linear(64, 1000, bias=True).to(dtype).requires_grad_(False)
    linear.weight.copy_(torch.randn(1000, 64, generator=torch.Generator().manual_seed(6)).to(dtype))
    layer = NativeLinear(linear, row_limited, keep_weight=False)
    x = torch.randn(40, 64, generator=torch.Generator().manual_seed(7)).to(dtype)
    got = layer(x)
    assert got.shape == (40, 1000)
    want = x.double() @ linear.weight.double().T + linear.bias.double()  # float32 sums rounded once
    magnitude = x.double().abs() @ linear.weight.double().abs().T + linear.bias.double().abs()
    unit = 2.0**-8 if dtype == torch.bfloat16 else 2.0**-24
    assert bool(((got.double() - want).abs() <= unit * want.abs() + 64 * 2.0**-23 * magnitude).all())
    for n0 in (0, 96, 960):  # each slice is oneDNN's product of that slice
        n1 = min(1000, n0 + 96)
        assert same_bits(got[:, n0:n1].contiguous(), F.linear(x, linear.weight[n0:n1], linear.bias[n0:n1]))


@pytest.mark.parametrize("shape", [(300, 64), (100, 70), (33, 17)])
def test_a_packed_only_linear_unpacks_its_weight_and_has_no_other_copy(packed_only, shape):
    linear = nn.Linear(shape[1], shape[0], bias=False).to(packed_only.dtype).requires_grad_(False)
    linear.weight.copy_(weights(shape, packed_only.dtype, seed=1))
    layer = NativeLinear(linear, packed_only, keep_weight=False)
    assert not layer.keeps_weight and not hasattr(layer, "weight") and "weight" not in layer.state_dict()
    assert same_bits(layer.unpacked(), linear.weight)
    with pytest.raises(AttributeError, match="unpacked"):
        layer.weight  # noqa: B018


@pytest.mark.parametrize("shape", [(300, 64), (1000, 576), (100, 70), (33, 17)])
def test_panel_embedding_equals_f_embedding(packed_only, shape):
    table = weights(shape, packed_only.dtype, seed=2)
    embedding = nn.Embedding(*shape).to(packed_only.dtype)
    embedding.weight.data.copy_(table)
    head = nn.Linear(shape[1], shape[0], bias=False).to(packed_only.dtype)
    head.weight = embedding.weight
    model = nn.ModuleDict({"embed": embedding, "head": head})
    pack_linear_layers(model, {packed_only.dtype: LinearRule("torch", "test", packed_only)})
    assert isinstance(model["embed"], PanelEmbedding)
    n = shape[0]
    ids = torch.tensor([0, n - 1, 15, 16, 17, 31, 32, n // 2, 5, 5])
    assert same_bits(model["embed"](ids), F.embedding(ids, table))
    grid = torch.randint(0, n, (3, 7), generator=torch.Generator().manual_seed(3))
    assert same_bits(model["embed"](grid), F.embedding(grid, table))  # any shape of ids
    assert same_bits(model["embed"](grid.int()), F.embedding(grid, table))
    for bad in (torch.tensor([0, n]), torch.tensor([-1])):
        with pytest.raises(IndexError, match=f"\\[0, {n}\\)"):
            model["embed"](bad)


def tied_llama(dtype: torch.dtype):
    from transformers import LlamaConfig

    from podium.models.registry import build_model, init_random_weights
    from podium_plugin_api.ops import build_op_table

    # every size a multiple of 64: no layout pads (so the bound below is about copies, not padding)
    config = LlamaConfig(vocab_size=4096, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    model = build_model(config, build_op_table(), dtype, "cpu")
    init_random_weights(model, seed=0)
    return model


def held_bytes(model: nn.Module) -> int:
    """Bytes of every tensor the model's modules hold (parameters, buffers, plain tensor attributes),
    each storage once."""
    seen, total = set(), 0
    for module in model.modules():
        tensors = [*module._parameters.values(), *module._buffers.values(),
                   *(v for v in vars(module).values() if isinstance(v, torch.Tensor))]
        for tensor in tensors:
            if tensor is None or tensor.untyped_storage().data_ptr() in seen:
                continue
            seen.add(tensor.untyped_storage().data_ptr())
            total += tensor.untyped_storage().nbytes()
    return total


def test_a_tied_llama_holds_one_copy_of_its_weights(packed_only, kernels):
    model = tied_llama(packed_only.dtype)
    plain = held_bytes(model)
    ids = torch.arange(0, 4096, 37)
    want = model.model.embed_tokens(ids)
    pack_linear_layers(model, {packed_only.dtype: LinearRule("torch", "test", packed_only)})
    native_embeddings(model, kernels)
    assert isinstance(model.model.embed_tokens, PanelEmbedding)
    assert all(not m.keeps_weight for m in model.modules() if isinstance(m, NativeLinear))
    assert held_bytes(model) <= 1.02 * plain
    assert same_bits(model.model.embed_tokens(ids), want)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_prepare_model_keeps_a_second_copy_only_where_its_rule_needs_the_plain_weight(dtype):
    platform = CpuPlatform()
    rule = platform.linear_rules()[dtype]
    model = tied_llama(dtype)
    plain = held_bytes(model)
    platform.prepare_model(model)
    if rule.native is not None and rule.native.packed_only:
        assert held_bytes(model) <= 1.02 * plain
    elif rule.native is not None:  # a row limit and no unpack: the plain weights stay for the batches above it
        assert isinstance(model.lm_head, NativeLinear) and model.lm_head.keeps_weight
        assert held_bytes(model) <= 2.02 * plain


def test_the_amx_plain_weights_option_keeps_the_plain_copy_for_prefill():
    platform = CpuPlatform()
    platform.activate(resolve_options("cpu", platform.options(), {"amx_plain_weights": "true"}))
    rule = platform.linear_rules()[torch.bfloat16]
    if rule.native is None or rule.native.every_batch:
        pytest.skip("no row-limited (AMX) bf16 linear kernel on this CPU")
    assert not rule.native.packed_only
    model = tied_llama(torch.bfloat16)
    plain = held_bytes(model)
    platform.prepare_model(model)
    assert isinstance(model.lm_head, NativeLinear) and model.lm_head.keeps_weight
    assert 1.5 * plain <= held_bytes(model) <= 2.02 * plain
