"""The CPU platform's fused ops and packed linears against the pure-torch references."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from podium_cpu import CpuPlatform, fused_ops
from podium_cpu.linear_choice import AMX_MAX_ROWS, LinearRule, runnable_native_kernels
from podium_cpu.linear_packing import (
    NativeLinear,
    PanelEmbedding,
    amx_tiles,
    f32_panels,
    fma_panels,
    pack_linear_layers,
)
from podium_cpu.onednn_linear import PackedLinear, can_pack, packing_unavailable
from podium_plugin_api import ops as reference


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
    x16 = torch.randn(4, 96).half()  # float16: the reference, exactly
    assert torch.equal(fused_ops.rms_norm(kernels, x16, weight.half(), 1e-6), reference.rms_norm(x16, weight.half(), 1e-6))


@pytest.mark.parametrize("rows,cols", [(1, 576), (33, 576), (5, 93), (300, 64)])
def test_rms_norm_float32_is_the_reference_within_float32_rounding(kernels, rows, cols):
    """Only the sum of squares runs in another order than torch's: a few float32 ulps at most."""
    gen = torch.Generator().manual_seed(rows)
    x, residual, weight = (torch.randn(rows, cols, generator=gen) * 3), torch.randn(rows, cols, generator=gen), \
        torch.randn(cols, generator=gen)
    want = reference.rms_norm(x.double(), weight.double(), 1e-5)
    got = fused_ops.rms_norm(kernels, x, weight, 1e-5)
    assert got.dtype == torch.float32 and (got.double() - want).abs().max() <= 8 * 2.0**-24 * want.abs().max()
    normed, summed = fused_ops.fused_add_rms_norm(kernels, x, residual, weight, 1e-5)
    assert torch.equal(summed, x + residual)  # one float32 rounding, as torch's
    want = reference.rms_norm(summed.double(), weight.double(), 1e-5)
    assert (normed.double() - want).abs().max() <= 8 * 2.0**-24 * want.abs().max()


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
    x32 = torch.randn(5, 192) * 4  # float32: e^x within a few ulps of torch's
    got, want = fused_ops.silu_and_mul(kernels, x32), reference.silu_and_mul(x32.double())
    assert got.dtype == torch.float32 and bool(((got.double() - want).abs() <= 4 * 2.0**-23 * want.abs()).all())
    x16 = torch.randn(5, 192).half()  # float16: the reference, exactly
    assert torch.equal(fused_ops.silu_and_mul(kernels, x16), reference.silu_and_mul(x16))
    x3 = torch.randn(2, 3, 64).bfloat16()  # more than two dims: the reference
    assert torch.equal(fused_ops.silu_and_mul(kernels, x3), reference.silu_and_mul(x3))
    odd = torch.randn(4, 7).bfloat16()  # no even split: the reference's error
    with pytest.raises(RuntimeError):
        fused_ops.silu_and_mul(kernels, odd)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_argmax_is_torchs_first_index_of_the_maximum(kernels, dtype):
    """Many ties (the first index wins, whichever vector lane holds it), NaN the maximum (its first
    index), an infinity, all -inf, rows shorter than a vector and with a ragged tail; the kit's
    conformance check too."""
    from podium_plugin_api.testing.op_checks import check_op

    gen = torch.Generator().manual_seed(7)
    for vocab in (1, 5, 16, 17, 4999, 49152):
        x = torch.randint(-4, 4, (12, vocab), generator=gen).to(dtype)
        if vocab > 16:
            x[1, vocab - 1] = 9  # the maximum in the tail or the last vector
            x[2, 7], x[2, vocab // 2] = float("nan"), float("nan")
            x[3, 10], x[3, vocab - 1] = float("inf"), float("nan")
            x[4] = float("-inf")
            x[5, 3], x[5, vocab - 1] = 5, 5  # a tie across lanes: index 3
        got = fused_ops.argmax(kernels, x)
        assert got.dtype == torch.int64 and torch.equal(got, x.argmax(dim=-1)), (vocab, got)
    wide = torch.randn(4, 100, generator=gen).to(dtype)
    assert torch.equal(fused_ops.argmax(kernels, wide[:, ::2]), wide[:, ::2].argmax(dim=-1))  # strided: reference
    check_op("argmax", CpuPlatform().custom_ops()["argmax"], dtype, "cpu", "platform.custom_ops()")


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


# --- linears ----------------------------------------------------------------------------------


def test_packing_is_refused_exactly_where_onednn_has_no_bf16_matmul():
    """The probe agrees with what oneDNN does with a real weight."""
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.ones(64, 64).bfloat16(), 32)
        refused = False
    except RuntimeError:
        refused = True
    assert can_pack(torch.bfloat16) == (not refused) and bool(packing_unavailable()) == refused
    assert can_pack(torch.float32) == (packing_unavailable(torch.float32) == "")
    assert not can_pack(torch.float16) and "float16" in packing_unavailable(torch.float16)


ONEDNN_ONLY = {dtype: LinearRule("onednn", "test") for dtype in (torch.bfloat16, torch.float32)}


@pytest.mark.skipif(not can_pack(torch.bfloat16), reason=packing_unavailable() or "packing available")
def test_packed_linear_is_bit_identical_to_f_linear():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(96, 200, bias=True), nn.ReLU(), nn.Linear(200, 64, bias=False)).bfloat16()
    x = torch.randn(5, 3, 96).bfloat16()
    want = model(x)
    first_weight = model[0].weight
    assert pack_linear_layers(model, ONEDNN_ONLY) == 2
    assert isinstance(model[0], PackedLinear) and model[0].weight is first_weight
    assert sorted(dict(model.named_parameters())) == ["0.bias", "0.weight", "2.weight"]
    for rows in (1, 7, 64):
        xs = torch.randn(rows, 96).bfloat16()
        assert torch.equal(model[0](xs), F.linear(xs, first_weight, model[0].bias))
    assert torch.equal(model(x), want)
    only_bf16 = {torch.bfloat16: ONEDNN_ONLY[torch.bfloat16]}
    assert pack_linear_layers(nn.Sequential(nn.Linear(4, 4)), only_bf16) == 0  # float32 left as it is


@pytest.mark.skipif(not can_pack(torch.float32), reason=packing_unavailable(torch.float32) or "packing available")
def test_float32_packing_is_accurate_for_every_batch_size():
    """oneDNN's packed fp32 matmul: within float32 rounding of the exact result at every row count."""
    torch.manual_seed(4)
    model = nn.Sequential(nn.Linear(576, 960), nn.Linear(960, 1536, bias=False)).requires_grad_(False)
    first = model[0].weight
    assert pack_linear_layers(model, ONEDNN_ONLY) == 2
    assert isinstance(model[0], PackedLinear) and model[0].weight is first and model[0].dtype == torch.float32
    x = torch.randn(300, 576)
    want = x.double() @ first.double().T + model[0].bias.double()
    bound = 576 * 2.0**-23 * (x.double().abs() @ first.double().abs().T + model[0].bias.double().abs())
    for rows in (1, 2, 7, 31, 32, 33, 64, 255, 300):
        got = model[0](x[:rows])
        assert got.dtype == torch.float32 and got.shape == (rows, 960)
        assert bool(((got.double() - want[:rows]).abs() <= bound[:rows]).all()), rows
    assert model[0](x.reshape(3, 100, 576)).shape == (3, 100, 960)  # leading dims kept


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_tied_lm_head_is_packed_as_the_rules_say_and_gives_the_logits(dtype):
    from transformers import LlamaConfig

    from podium.models.registry import build_model, init_random_weights
    from podium_plugin_api.ops import build_op_table

    config = LlamaConfig(vocab_size=4096, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    model = build_model(config, build_op_table(), dtype, "cpu")
    init_random_weights(model, seed=0)
    embedding = model.model.embed_tokens.weight
    assert model.lm_head.weight is embedding  # tied again after materialization
    hidden = torch.randn(32, 64).to(dtype)
    want = hidden.double() @ embedding.double().T
    platform = CpuPlatform()
    choice = platform.linear_kernel(dtype, 4096, 64, rows=32)
    replaced = pack_linear_layers(model, platform.linear_rules())
    assert replaced == (0 if choice.kernel == "torch" else 5)  # q|k|v, o, gate|up, down, lm_head
    assert getattr(model.lm_head, "kernel_name", "torch") == choice.kernel
    if getattr(model.lm_head, "keeps_weight", True):
        assert model.lm_head.weight is embedding
    else:  # one copy: the embedding reads the head's packed weight
        assert isinstance(model.model.embed_tokens, PanelEmbedding) and model.model.embed_tokens.packed is model.lm_head.packed
    got = model.compute_logits(hidden)
    assert got.dtype == dtype and (got.double() - want).abs().max() <= 2e-2 * want.abs().max()


def test_the_rules_name_a_kernel_for_every_dtype_and_batch():
    platform = CpuPlatform()
    for dtype in (torch.bfloat16, torch.float32, torch.float16):
        for rows in (1, 64, AMX_MAX_ROWS + 1, 4096):
            choice = platform.linear_kernel(dtype, 960, 576, rows)
            assert choice.kernel in ("amx", "avx512-bf16", "fma", "onednn", "torch") and "960" in choice.reason
    assert platform.linear_kernel(torch.float16, 8, 8, 1).kernel == "torch"
    with pytest.raises(ValueError, match="positive sizes"):
        platform.linear_kernel(torch.float32, 8, 8, 0)
    extra = platform.capabilities().extra  # podium platforms --verbose prints these
    assert {key for key in extra if key.startswith("linears ")} == {"linears bfloat16", "linears float32",
                                                                     "linears float16"}
    assert extra["linears float16"].startswith("torch: ")


def test_the_rules_take_the_fastest_kernel_this_cpu_runs(kernels):
    """Where a native kernel runs, decode-sized batches use it (and so are captured); the order of
    preference: AMX, AVX512-BF16, oneDNN, FMA for bf16; FMA, oneDNN for float32."""
    platform = CpuPlatform()
    runnable = {(k.name, k.dtype) for k in runnable_native_kernels(kernels)}
    bf16 = platform.linear_kernel(torch.bfloat16, 576, 576, 32).kernel
    for name in ("amx", "avx512-bf16"):
        if (name, torch.bfloat16) in runnable:
            assert bf16 == name
            break
    else:
        assert bf16 == ("onednn" if can_pack(torch.bfloat16) else "fma" if ("fma", torch.bfloat16) in runnable
                        else "torch")
    f32 = platform.linear_kernel(torch.float32, 576, 576, 32).kernel
    assert f32 == ("fma" if ("fma", torch.float32) in runnable else "onednn" if can_pack(torch.float32) else "torch")


@pytest.mark.parametrize("forced", ["amx", "avx512-bf16", "fma", "onednn"])
def test_the_linears_option_forces_its_kernel_where_it_runs_and_refuses_elsewhere(kernels, forced):
    """A named kernel replaces the rule of each dtype it computes here (the rest keep theirs); one that
    computes none here is an error naming the option, never another kernel."""
    runnable = {(k.name, k.dtype) for k in runnable_native_kernels(kernels)}
    computes = {dtype for dtype in (torch.bfloat16, torch.float32)
                if ((forced, dtype) in runnable if forced != "onednn" else can_pack(dtype))}
    platform = CpuPlatform()
    platform.activate({"attention": "auto", "kv_cache_commit": False, "linears": forced, "amx": True, "amx_plain_weights": False})
    if not computes:
        with pytest.raises(ValueError, match=f"linears option is {forced}, which runs no dtype here"):
            platform.linear_rules()
        return
    auto = CpuPlatform()
    for dtype in (torch.bfloat16, torch.float32, torch.float16):
        for rows in (1, 32, AMX_MAX_ROWS + 1):
            got = platform.linear_kernel(dtype, 576, 1536, rows)
            if dtype not in computes:
                assert got == auto.linear_kernel(dtype, 576, 1536, rows)
            elif (native := platform.linear_rules()[dtype].native) is not None and not native.takes(rows):
                assert got.kernel == "onednn" and native.name == forced  # a row limit (AMX; float32 FMA on AMX)
            else:
                assert got.kernel == forced and "forced by the linears option" in got.reason, (dtype, rows, got)


def test_the_amx_option_off_runs_the_cpu_as_one_without_amx(kernels):
    """Off: no linear on AMX tiles (the rule a CPU with AVX512-BF16 and no AMX has) and attention
    tiles without them; forcing the amx kernel then is an error."""
    platform = CpuPlatform()
    platform.activate({"attention": "auto", "kv_cache_commit": False, "linears": "auto", "amx": False, "amx_plain_weights": False})
    for rows in (1, 32, AMX_MAX_ROWS + 1):
        got = platform.linear_kernel(torch.bfloat16, 576, 1536, rows).kernel
        assert got != "amx" and got == ("avx512-bf16" if kernels.dpbf16_linear else got), (rows, got)
    assert platform.attention_backend().amx is False
    platform.activate({"attention": "auto", "kv_cache_commit": False, "linears": "amx", "amx": False, "amx_plain_weights": False})
    with pytest.raises(ValueError, match="linears option is amx, which runs no dtype here"):
        platform.linear_rules()


@pytest.fixture(scope="module", params=["amx-bfloat16", "avx512-bf16-bfloat16", "fma-bfloat16", "fma-float32"])
def native_kernel(request, kernels):
    """Each native linear kernel this CPU runs, chosen by the rules or not."""
    found = {f"{k.name}-{str(k.dtype).removeprefix('torch.')}": k for k in runnable_native_kernels(kernels)}
    if request.param not in found:
        pytest.skip(f"the {request.param} linear kernel does not run on this CPU")
    return found[request.param]


@pytest.mark.parametrize("shape", [(960, 576), (49152, 576), (100, 70), (33, 64), (16, 31), (1, 1), (72, 7)])
@pytest.mark.parametrize("layout,dtype,kind", [(amx_tiles, torch.bfloat16, "amx"), (fma_panels, torch.bfloat16, "fma"),
                                               (f32_panels, torch.float32, "fma")], ids=["amx", "fma-bf16", "fma-f32"])
def test_native_packing_is_the_torch_layout_bit_for_bit(kernels, layout, dtype, kind, shape):
    """The load-time packers write exactly the torch definition of their layout, zero padding included."""
    pack = getattr(kernels, f"{kind}_pack")[dtype]  # plain C: there wherever the library loads
    weight = torch.randn(shape, generator=torch.Generator().manual_seed(shape[0])).to(dtype)
    want = layout(weight)
    assert torch.equal(layout(weight, pack), want)
    assert torch.equal(layout(weight.t().contiguous().t(), pack), want)  # a non-contiguous weight


def exact_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x . weight^T + bias in float64: exact here for bf16 (products exact, short sums)."""
    out = x.double() @ weight.double().T
    return out if bias is None else out + bias.double()


def assert_rounded_once(got: torch.Tensor, x, weight, bias, what) -> None:
    """got is the exact result with float32 sums (error below K ulps of the sum of |terms|) rounded
    once to its dtype, and its typical error is a rounding's plus a random walk's over K sums, far
    below the bound."""
    want = exact_linear(x, weight, bias)
    magnitude = exact_linear(x.abs(), weight.abs(), None if bias is None else bias.abs())
    unit = 2.0**-8 if got.dtype == torch.bfloat16 else 2.0**-24
    bound = unit * want.abs() + x.shape[1] * 2.0**-23 * magnitude
    error = (got.double() - want).abs()
    assert bool((error <= bound).all()), what
    typical = 2 * unit * float(want.abs().mean()) + x.shape[1] ** 0.5 * 2.0**-24 * float(magnitude.mean())
    assert float(error.mean()) < typical, what  # not merely within bounds


@pytest.mark.parametrize("features", [(576, 960), (70, 100), (1536, 576), (64, 33), (7, 50), (33, 17)])
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no-bias"])
def test_native_linear_rounds_the_exact_result_once(native_kernel, features, bias):
    in_features, out_features = features
    torch.manual_seed(0)
    linear = nn.Linear(in_features, out_features, bias=bias).to(native_kernel.dtype).requires_grad_(False)
    layer = NativeLinear(linear, native_kernel)
    for rows in (1, 2, 5, 6, 7, 16, 17, 32, 33, 45, 64, 100):
        x = torch.randn(rows, in_features).to(native_kernel.dtype)
        got = layer(x)
        assert got.dtype == native_kernel.dtype and got.shape == (rows, out_features)
        assert_rounded_once(got, x, linear.weight, linear.bias, (native_kernel.name, rows))


def test_native_linear_rows_do_not_depend_on_the_batch(native_kernel):
    torch.manual_seed(1)
    linear = nn.Linear(96, 200, bias=False).to(native_kernel.dtype).requires_grad_(False)
    layer = NativeLinear(linear, native_kernel)
    wide = torch.randn(100, 150).to(native_kernel.dtype)
    x = wide[:, :96]  # rows 150 apart: read in place, no copy
    batch = layer(x)
    # first, last of a 32-row AMX chunk / 48-row FMA chunk, register blocks of 5 and 6, the last chunk
    for i in (0, 5, 6, 31, 32, 47, 48, 63, 64, 99):
        assert torch.equal(layer(x[i:i + 1]), batch[i:i + 1])
    for rows in (7, 33, 64):  # other batch sizes split the rows into other register blocks
        assert torch.equal(layer(x[:rows]), batch[:rows])
    assert torch.equal(layer(x.reshape(4, 25, 96)), batch.reshape(4, 25, 200))


@pytest.mark.parametrize("features", [(576, 576), (576, 960), (1536, 200)])
def test_native_linear_prefill_batches_are_exact_and_batch_invariant(native_kernel, features):
    """Every kernel given prefill-sized batches (as the batch-invariant mode gives them), where AMX
    meets blocks of 256 rows with groups of column blocks that stay in L2: every row rounded once from
    its exact sum, and equal to the same row computed alone."""
    in_features, out_features = features
    torch.manual_seed(5)
    linear = nn.Linear(in_features, out_features).to(native_kernel.dtype).requires_grad_(False)
    layer = NativeLinear(linear, dataclasses.replace(native_kernel, max_rows=None))
    x = torch.randn(1000, in_features).to(native_kernel.dtype)  # 3 full blocks of 256 rows and a partial one
    batch = layer(x)
    assert_rounded_once(batch, x, linear.weight, linear.bias, (native_kernel.name, features))
    for i in (0, 255, 256, 511, 767, 768, 999):
        assert torch.equal(layer(x[i:i + 1]), batch[i:i + 1]), i
    assert torch.equal(layer(x[:600]), batch[:600])


def test_native_linear_takes_the_batches_its_rule_says(native_kernel):
    torch.manual_seed(3)
    linear = nn.Linear(64, 48).to(native_kernel.dtype).requires_grad_(False)
    layer = NativeLinear(linear, native_kernel)
    rows = 1000 if native_kernel.max_rows is None else native_kernel.max_rows + 1
    x = torch.randn(rows, 64).to(native_kernel.dtype)
    got = layer(x)
    if native_kernel.max_rows is not None:  # above its rows: F.linear
        assert torch.equal(got, F.linear(x, linear.weight, linear.bias))
    assert_rounded_once(got, x, linear.weight, linear.bias, rows)


def test_native_packing_keeps_parameters_and_ties(native_kernel):
    embedding = nn.Embedding(300, 64).to(native_kernel.dtype)
    head = nn.Linear(64, 300, bias=False).to(native_kernel.dtype)
    head.weight = embedding.weight
    other = torch.float16
    model = nn.ModuleDict({"embed": embedding, "head": head, "f16": nn.Linear(4, 4).to(other)})
    assert pack_linear_layers(model, {native_kernel.dtype: LinearRule("onednn", "test", native_kernel)}) == 1
    assert isinstance(model["head"], NativeLinear)
    if native_kernel.packed_only:  # packed only: the tied embedding reads the head's packed weight
        assert not model["head"].keeps_weight and isinstance(model["embed"], PanelEmbedding)
        assert sorted(dict(model.named_parameters())) == ["f16.bias", "f16.weight"]
    else:  # no unpack: the plain weight stays for the batches above the kernel's rows, and with it the tie
        assert model["head"].weight is embedding.weight and model["embed"] is embedding
        assert sorted(dict(model.named_parameters())) == ["embed.weight", "f16.bias", "f16.weight"]


@pytest.mark.parametrize("rows", [1, 5, 32, 50, 64])
@pytest.mark.parametrize("bias", [False, True])
def test_fused_norm_and_silu_linears_equal_the_op_then_the_linear_bit_for_bit(kernels, native_kernel, rows, bias):
    """rms_norm_linear / silu_and_mul_linear into a NativeLinear: one native call whose input pass
    runs the same row code as the ops alone (native/prologue.h), so the result is theirs exactly."""
    dtype = native_kernel.dtype
    gen = torch.Generator().manual_seed(rows)
    # 90: not a multiple of AMX's 32-input tiles (a padded input); 72: a partial last panel / tile pair;
    # 161: an odd input (AVX512-BF16 stages it with a zero after the last value)
    hidden, inter, out_features = 90, 161, 72
    calls = []
    # the fused entry counts its calls, so "equal to the separate ops" cannot come from not fusing
    counted = dataclasses.replace(native_kernel, fused=lambda *args: calls.append(1) or native_kernel.fused(*args))

    def layer(k: int):
        plain = nn.Linear(k, out_features, bias=bias).requires_grad_(False)
        plain.weight.copy_(torch.randn(out_features, k, generator=gen) / k**0.5)
        if bias:
            plain.bias.copy_(torch.randn(out_features, generator=gen))
        return NativeLinear(plain.to(dtype), counted)

    qkv, down = layer(hidden), layer(inter)
    x = torch.randn(rows, hidden, generator=gen).to(dtype)
    residual = torch.randn(rows, hidden, generator=gen).to(dtype)
    weight = (1 + 0.1 * torch.randn(hidden, generator=gen)).to(dtype)
    gate_up = torch.randn(rows, 2 * inter, generator=gen).mul(3).to(dtype)
    out, summed = fused_ops.rms_norm_linear(kernels, x, residual, weight, 1e-6, qkv)
    normed, want_sum = fused_ops.fused_add_rms_norm(kernels, x, residual, weight, 1e-6)
    assert torch.equal(out, qkv(normed)) and torch.equal(summed, want_sum)
    out, same = fused_ops.rms_norm_linear(kernels, x, None, weight, 1e-6, qkv)
    assert torch.equal(out, qkv(fused_ops.rms_norm(kernels, x, weight, 1e-6))) and same is x
    assert torch.equal(fused_ops.silu_and_mul_linear(kernels, gate_up, down),
                       down(fused_ops.silu_and_mul(kernels, gate_up)))
    # strided rows (a view into a wider buffer) take the fused path too
    wide = torch.randn(rows, 2 * inter + 8, generator=gen).to(dtype)[:, : 2 * inter]
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
