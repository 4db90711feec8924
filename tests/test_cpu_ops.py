"""The CPU platform's fused ops and packed linears against the pure-torch references."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from podium_cpu import fused_ops
from podium_cpu.linear_packing import (
    AMX_MAX_ROWS,
    AmxLinear,
    FmaLinear,
    PackedLinear,
    amx_tiles,
    can_pack,
    fma_panels,
    pack_linear_layers,
    packing_unavailable,
)
from podium_cpu.native_kernels import load_kernels
from podium_plugin_api import ops as reference


@pytest.fixture(scope="module")
def kernels():
    kernels, why = load_kernels()
    if kernels is None:
        pytest.skip(why)
    return kernels


def bf16_ulps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Distance in bf16 units in the last place (both bf16)."""
    return (a.view(torch.int16).int() - b.view(torch.int16).int()).abs()


@pytest.mark.parametrize("rows,cols", [(1, 576), (33, 576), (5, 96), (300, 64)])
def test_rms_norm_bf16_rounds_like_the_reference(kernels, rows, cols):
    gen = torch.Generator().manual_seed(rows)
    x = (torch.randn(rows, cols, generator=gen) * 3).bfloat16()
    residual = torch.randn(rows, cols, generator=gen).bfloat16()
    weight = torch.randn(cols, generator=gen).bfloat16()
    got = fused_ops.rms_norm(kernels, x, weight, 1e-5)
    want = reference.rms_norm(x, weight, 1e-5)
    # only the sum of squares runs in another order: at most one bf16 ulp, on few elements
    assert bf16_ulps(got, want).max() <= 1 and (got != want).float().mean() < 0.02
    normed, summed = fused_ops.fused_add_rms_norm(kernels, x, residual, weight, 1e-5)
    want_normed, want_summed = reference.fused_add_rms_norm(x, residual, weight, 1e-5)
    assert torch.equal(summed, want_summed)
    assert bf16_ulps(normed, want_normed).max() <= 1 and (normed != want_normed).float().mean() < 0.02


def test_rms_norm_strided_rows_and_fallbacks(kernels):
    wide = torch.randn(7, 200).bfloat16()
    x = wide[:, :96]  # rows 200 apart
    weight = torch.randn(96).bfloat16()
    assert bf16_ulps(fused_ops.rms_norm(kernels, x, weight, 1e-6), reference.rms_norm(x, weight, 1e-6)).max() <= 1
    x32 = torch.randn(4, 96)
    assert torch.equal(fused_ops.rms_norm(kernels, x32, weight.float(), 1e-6), reference.rms_norm(x32, weight.float(), 1e-6))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_rotary_is_bit_identical_to_the_reference(kernels, dtype):
    gen = torch.Generator().manual_seed(0)
    tokens, heads, kv_heads, d = 11, 9, 3, 64
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * d, generator=gen).to(dtype)
    q = qkv[:, : heads * d].view(tokens, heads, d)  # strided views, as the model passes them
    k = qkv[:, heads * d : (heads + kv_heads) * d].view(tokens, kv_heads, d)
    angles = torch.arange(100)[:, None] * (10000.0 ** (-torch.arange(0, d, 2) / d))[None, :]
    cos_sin = torch.cat((angles.cos(), angles.sin()), dim=-1)
    positions = torch.randint(0, 100, (tokens,), generator=gen)
    got_q, got_k = fused_ops.rotary_embedding(kernels, positions, q, k, cos_sin)
    want_q, want_k = reference.rotary_embedding(positions, q, k, cos_sin)
    assert torch.equal(got_q, want_q) and torch.equal(got_k, want_k)
    with pytest.raises(ValueError, match="positions"):
        fused_ops.rotary_embedding(kernels, torch.tensor([100] * tokens), q, k, cos_sin)


@pytest.mark.parametrize("rows,inter", [(1, 5), (7, 37), (32, 1536), (300, 64), (3, 16)])
def test_silu_and_mul_bf16_rounds_like_torch(kernels, rows, inter):
    gen = torch.Generator().manual_seed(rows * 1000 + inter)
    x = (torch.randn(rows, 2 * inter, generator=gen) * 4).bfloat16()
    got = fused_ops.silu_and_mul(kernels, x)
    want = reference.silu_and_mul(x)
    assert got.shape == want.shape == (rows, inter) and got.dtype == torch.bfloat16
    # silu's e^x is not torch's: at most one bf16 rounding apart, and rarely (none seen so far)
    assert bf16_ulps(got, want).max() <= 1 and (got != want).float().mean() < 1e-3


def test_silu_and_mul_every_bf16_gate_and_special_values(kernels):
    gates = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)  # every bf16
    for up in (1.0, -3.0, 1e-30, float("inf")):
        x = torch.cat((gates, torch.full_like(gates, up)))[None, :]  # [1, 2 * 65536]
        got, want = fused_ops.silu_and_mul(kernels, x), reference.silu_and_mul(x)
        assert torch.equal(got.isnan(), want.isnan())
        finite = ~want.isnan()
        assert bf16_ulps(got[finite], want[finite]).max() <= 1
        assert (got[finite] != want[finite]).float().mean() < 1e-4
        special = gates.float().abs() > 80  # overflowing e^-g, infinities, tiny products
        assert torch.equal(got[0, special & finite[0]], want[0, special & finite[0]])


def test_silu_and_mul_strided_rows_and_fallbacks(kernels):
    wide = torch.randn(9, 300).bfloat16()
    x = wide[:, :192]  # rows 300 apart: [9, 2 * 96]
    assert bf16_ulps(fused_ops.silu_and_mul(kernels, x), reference.silu_and_mul(x)).max() <= 1
    x32 = torch.randn(5, 192)  # float32 stays the reference, exactly
    assert torch.equal(fused_ops.silu_and_mul(kernels, x32), reference.silu_and_mul(x32))
    x3 = torch.randn(2, 3, 64).bfloat16()  # more than two dims: the reference
    assert torch.equal(fused_ops.silu_and_mul(kernels, x3), reference.silu_and_mul(x3))
    odd = torch.randn(4, 7).bfloat16()  # no even split: the reference's error
    with pytest.raises(RuntimeError):
        fused_ops.silu_and_mul(kernels, odd)


def test_top_k_prefilter_keeps_what_the_reference_keeps():
    gen = torch.Generator().manual_seed(0)
    logits = torch.stack([torch.randperm(5000, generator=gen) for _ in range(6)]).float().mul(0.01)
    top_k = torch.tensor([1, 5, 50, 300, 20, 7])
    top_p = torch.tensor([1.0, 0.5, 0.9, 0.95, 0.3, 1.0])
    got = fused_ops.top_k_top_p(logits, top_k, top_p)
    want = reference.top_k_top_p(logits, top_k, top_p)
    assert torch.equal(got, want)
    # a row without top-k needs the whole sort: same answer through the reference
    top_k[2] = 0
    assert torch.equal(fused_ops.top_k_top_p(logits, top_k, top_p), reference.top_k_top_p(logits, top_k, top_p))


def test_packing_is_refused_exactly_where_onednn_has_no_bf16_matmul():
    """The probe agrees with what oneDNN does with a real weight, and packing nothing is not an error."""
    model = nn.Sequential(nn.Linear(64, 64)).bfloat16()
    try:
        torch.ops.mkldnn._reorder_linear_weight(model[0].weight.detach(), 32)
        refused = False
    except RuntimeError:
        refused = True
    assert can_pack(torch.bfloat16) == (not refused) and bool(packing_unavailable()) == refused
    assert pack_linear_layers(model) == (0 if refused else 1)
    assert can_pack(torch.float32) == (packing_unavailable(torch.float32) == "")
    assert not can_pack(torch.float16) and "float16" in packing_unavailable(torch.float16)


@pytest.mark.skipif(not can_pack(torch.bfloat16), reason=packing_unavailable() or "packing available")
def test_packed_linear_is_bit_identical_to_f_linear():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(96, 200, bias=True), nn.ReLU(), nn.Linear(200, 64, bias=False)).bfloat16()
    x = torch.randn(5, 3, 96).bfloat16()
    want = model(x)
    first_weight = model[0].weight
    assert pack_linear_layers(model) == 2
    assert isinstance(model[0], PackedLinear) and model[0].weight is first_weight
    assert sorted(dict(model.named_parameters())) == ["0.bias", "0.weight", "2.weight"]
    for rows in (1, 7, 64):
        xs = torch.randn(rows, 96).bfloat16()
        assert torch.equal(model[0](xs), F.linear(xs, first_weight, model[0].bias))
    assert torch.equal(model(x), want)
    assert pack_linear_layers(nn.Sequential(nn.Linear(4, 4)), float32=False) == 0  # float32 left as it is


@pytest.mark.skipif(not can_pack(torch.float32), reason=packing_unavailable(torch.float32) or "packing available")
def test_float32_packing_is_accurate_for_every_batch_size():
    """oneDNN's packed fp32 matmul: within float32 rounding of the exact result at every row count.
    (Bit-equal rows across batch sizes held with torch 2.13's oneDNN at 1-256 rows, not with torch
    2.8's, nor for MKL's F.linear: not asserted.)"""
    torch.manual_seed(4)
    model = nn.Sequential(nn.Linear(576, 960), nn.Linear(960, 1536, bias=False)).requires_grad_(False)
    first = model[0].weight
    assert pack_linear_layers(model) == 2
    assert isinstance(model[0], PackedLinear) and model[0].weight is first and model[0].dtype == torch.float32
    x = torch.randn(300, 576)
    want = x.double() @ first.double().T + model[0].bias.double()
    bound = 576 * 2.0**-23 * (x.double().abs() @ first.double().abs().T + model[0].bias.double().abs())
    for rows in (1, 2, 7, 31, 32, 33, 64, 255, 300):
        got = model[0](x[:rows])
        assert got.dtype == torch.float32 and got.shape == (rows, 960)
        assert bool(((got.double() - want[:rows]).abs() <= bound[:rows]).all()), rows
    assert model[0](x.reshape(3, 100, 576)).shape == (3, 100, 960)  # leading dims kept


@pytest.mark.skipif(not can_pack(torch.bfloat16), reason=packing_unavailable() or "packing available")
def test_tied_lm_head_is_packed_and_gives_the_unpacked_logits():
    from transformers import LlamaConfig

    from podium.models.registry import build_model, init_random_weights
    from podium_plugin_api.ops import build_op_table

    config = LlamaConfig(vocab_size=4096, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    model = build_model(config, build_op_table(), torch.bfloat16, "cpu")
    init_random_weights(model, seed=0)
    embedding = model.model.embed_tokens.weight
    assert model.lm_head.weight is embedding  # tied again after materialization
    hidden = torch.randn(32, 64).bfloat16()
    want = model.compute_logits(hidden)
    assert pack_linear_layers(model) == 5  # q|k|v, o, gate|up, down, lm_head
    assert isinstance(model.lm_head, PackedLinear) and model.lm_head.weight is embedding
    assert torch.equal(model.compute_logits(hidden), want) and want.dtype == torch.bfloat16


@pytest.fixture(scope="module")
def amx_kernel(kernels):
    kernel = kernels.amx_linear.get(torch.bfloat16)
    if kernel is None:
        pytest.skip("no AMX tiles on this CPU (or not granted to this process)")
    return kernel


@pytest.fixture(scope="module")
def amx_pack(kernels):
    return kernels.amx_pack[torch.bfloat16]  # plain C: there wherever the library loads


@pytest.fixture(scope="module", params=["amx", "fma"])
def native_linear(request, kernels):
    """(layer class, kernel, packer) of each native bf16 linear kernel this CPU runs."""
    kind = request.param
    kernel = getattr(kernels, f"{kind}_linear").get(torch.bfloat16)
    if kernel is None:
        pytest.skip(f"the {kind} linear kernel does not run on this CPU")
    return {"amx": AmxLinear, "fma": FmaLinear}[kind], kernel, getattr(kernels, f"{kind}_pack")[torch.bfloat16]


@pytest.mark.parametrize("shape", [(960, 576), (49152, 576), (100, 70), (33, 64), (16, 31), (1, 1)])
@pytest.mark.parametrize("layout,kind", [(amx_tiles, "amx"), (fma_panels, "fma")], ids=["amx", "fma"])
def test_native_packing_is_the_torch_layout_bit_for_bit(kernels, layout, kind, shape):
    """The load-time packers write exactly the torch definition of their layout, zero padding included."""
    pack = getattr(kernels, f"{kind}_pack")[torch.bfloat16]  # plain C: there wherever the library loads
    weight = torch.randn(shape, generator=torch.Generator().manual_seed(shape[0])).bfloat16()
    want = layout(weight)
    assert torch.equal(layout(weight, pack), want)
    assert torch.equal(layout(weight.t().contiguous().t(), pack), want)  # a non-contiguous weight


def exact_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x . weight^T + bias in float64: exact here (bf16 products, short sums)."""
    out = x.double() @ weight.double().T
    return out if bias is None else out + bias.double()


@pytest.mark.parametrize("features", [(576, 960), (70, 100), (1536, 576), (64, 33)])
def test_native_linear_rounds_the_exact_result_once(native_linear, features):
    layer_class, kernel, pack = native_linear
    in_features, out_features = features
    torch.manual_seed(0)
    linear = nn.Linear(in_features, out_features, bias=True).bfloat16().requires_grad_(False)
    layer = layer_class(linear, kernel, pack)
    for rows in (1, 5, 6, 16, 17, 32, 45, 100):
        x = torch.randn(rows, in_features).bfloat16()
        got = layer(x).double()
        want = exact_linear(x, linear.weight, linear.bias)
        magnitude = exact_linear(x.abs(), linear.weight.abs(), linear.bias.abs())
        # float32 sums (error below K ulps of the sum of |terms|), then one rounding to bf16
        bound = 2.0**-8 * want.abs() + in_features * 2.0**-23 * magnitude
        assert bool(((got - want).abs() <= bound).all()), rows
        assert float((got - want).abs().mean()) < 2.0**-9 * float(want.abs().mean())  # not merely within bounds


def test_native_linear_rows_do_not_depend_on_the_batch(native_linear):
    layer_class, kernel, _ = native_linear
    torch.manual_seed(1)
    linear = nn.Linear(96, 200, bias=False).bfloat16().requires_grad_(False)
    layer = layer_class(linear, kernel)
    wide = torch.randn(100, 150).bfloat16()
    x = wide[:, :96]  # rows 150 apart: read in place, no copy
    batch = layer(x)
    # first, last of a 32-row AMX chunk / 48-row FMA chunk, 6-row FMA blocks, inside the last chunk
    for i in (0, 5, 6, 31, 32, 47, 48, 63, 99):
        assert torch.equal(layer(x[i:i + 1]), batch[i:i + 1])
    assert torch.equal(layer(x.reshape(4, 25, 96)), batch.reshape(4, 25, 200))


def test_amx_linear_leaves_large_batches_to_onednn(amx_kernel):
    torch.manual_seed(2)
    linear = nn.Linear(64, 48).bfloat16().requires_grad_(False)
    x = torch.randn(AMX_MAX_ROWS + 1, 64).bfloat16()
    assert torch.equal(AmxLinear(linear, amx_kernel)(x), F.linear(x, linear.weight, linear.bias))


def test_fma_linear_takes_every_batch(native_linear):
    layer_class, kernel, _ = native_linear
    if layer_class is not FmaLinear:
        pytest.skip("the AMX kernel stops at AMX_MAX_ROWS (test above)")
    torch.manual_seed(3)
    linear = nn.Linear(64, 48).bfloat16().requires_grad_(False)
    x = torch.randn(1000, 64).bfloat16()
    got = FmaLinear(linear, kernel)(x).double()
    want = exact_linear(x, linear.weight, linear.bias)
    assert float((got - want).abs().max()) <= 2.0**-7 * float(want.abs().max())


def test_native_packing_keeps_parameters_and_ties(native_linear):
    layer_class, kernel, _ = native_linear
    embedding = nn.Embedding(300, 64).bfloat16()
    head = nn.Linear(64, 300, bias=False).bfloat16()
    head.weight = embedding.weight
    model = nn.ModuleDict({"embed": embedding, "head": head, "f32": nn.Linear(4, 4)})
    given = {"amx_kernel": kernel} if layer_class is AmxLinear else {"fma_kernel": kernel}
    assert pack_linear_layers(model, **given, float32=False) == 1  # float32 left as it is
    # oneDNN's packing comes before the FMA kernel where it can pack bf16
    want = PackedLinear if layer_class is FmaLinear and can_pack(torch.bfloat16) else layer_class
    assert isinstance(model["head"], want) and model["head"].weight is embedding.weight
    assert sorted(dict(model.named_parameters())) == ["embed.weight", "f32.bias", "f32.weight"]


@pytest.mark.parametrize("rows", [1, 5, 32, 50])
@pytest.mark.parametrize("bias", [False, True])
def test_fused_norm_and_silu_linears_equal_the_op_then_the_linear_bit_for_bit(kernels, native_linear, rows, bias):
    """rms_norm_linear / silu_and_mul_linear into a native linear (FmaLinear, AmxLinear): one native
    call whose input pass runs the same row code as the ops alone (native/prologue.h), so the result
    is theirs exactly."""
    layer_class, kernel, pack = native_linear
    gen = torch.Generator().manual_seed(rows)
    # 90: not a multiple of AMX's 32-input tiles (a padded input); 72: a partial last panel / tile pair
    hidden, inter, out_features = 90, 160, 72
    entry = {FmaLinear: "fma_fused_linear", AmxLinear: "amx_fused_linear"}[layer_class]
    real, calls = getattr(kernels, entry)[torch.bfloat16], []
    # the fused entry counts its calls, so "equal to the separate ops" cannot come from not fusing
    kernels = dataclasses.replace(kernels, **{entry: {torch.bfloat16: lambda *args: calls.append(1) or real(*args)}})

    def layer(k: int):
        plain = nn.Linear(k, out_features, bias=bias).requires_grad_(False)
        plain.weight.copy_(torch.randn(out_features, k, generator=gen) / k**0.5)
        if bias:
            plain.bias.copy_(torch.randn(out_features, generator=gen))
        return layer_class(plain.bfloat16(), kernel, pack)

    qkv, down = layer(hidden), layer(inter)
    x = torch.randn(rows, hidden, generator=gen).bfloat16()
    residual = torch.randn(rows, hidden, generator=gen).bfloat16()
    weight = (1 + 0.1 * torch.randn(hidden, generator=gen)).bfloat16()
    gate_up = torch.randn(rows, 2 * inter, generator=gen).mul(3).bfloat16()
    out, summed = fused_ops.rms_norm_linear(kernels, x, residual, weight, 1e-6, qkv)
    normed, want_sum = fused_ops.fused_add_rms_norm(kernels, x, residual, weight, 1e-6)
    assert torch.equal(out, qkv(normed)) and torch.equal(summed, want_sum)
    out, same = fused_ops.rms_norm_linear(kernels, x, None, weight, 1e-6, qkv)
    assert torch.equal(out, qkv(fused_ops.rms_norm(kernels, x, weight, 1e-6))) and same is x
    assert torch.equal(fused_ops.silu_and_mul_linear(kernels, gate_up, down),
                       down(fused_ops.silu_and_mul(kernels, gate_up)))
    # strided rows (a view into a wider buffer) take the fused path too
    wide = torch.randn(rows, 2 * inter + 8, generator=gen).bfloat16()[:, : 2 * inter]
    assert torch.equal(fused_ops.silu_and_mul_linear(kernels, wide, down), down(fused_ops.silu_and_mul(kernels, wide)))
    # and against the float64 reference, so "equal to the separate ops" is not equal to a shared bug
    want = reference.rms_norm_linear(x.double(), residual.double(), weight.double(), 1e-6,
                                     lambda h: F.linear(h, qkv.weight.double(), None if qkv.bias is None else qkv.bias.double()))[0]
    got = fused_ops.rms_norm_linear(kernels, x, residual, weight, 1e-6, qkv)[0]
    assert (got.double() - want).abs().max() <= 2e-2 * want.abs().max()
    assert len(calls) == 5


def test_fused_linears_leave_other_linears_to_the_op_then_the_module(kernels):
    plain = nn.Linear(64, 16).bfloat16()
    x = torch.randn(3, 64).bfloat16()
    out, _ = fused_ops.rms_norm_linear(kernels, x, None, torch.ones(64).bfloat16(), 1e-6, plain)
    assert torch.equal(out, plain(fused_ops.rms_norm(kernels, x, torch.ones(64).bfloat16(), 1e-6)))
