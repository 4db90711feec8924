"""INT4 AWQ and GPTQ (act-order) checkpoints: a tiny Llama quantized by this test into each format, with
``quantization_config`` as AutoAWQ / GPTQ write it; Podium loads it and its logits equal transformers'
on the same model with the weights dequantized by this test's own plain-torch reference."""

from __future__ import annotations

import itertools
import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

from podium import LLM, SamplingParams

GROUP = 128
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


def pack_columns(q: torch.Tensor, order=tuple(range(8))) -> torch.Tensor:
    """int [R, C] of 0..15 -> int32 [R, C/8]: nibble i of an int32 holds column 8j + order[i]."""
    q = q.reshape(q.shape[0], -1, 8).long()
    return _to_int32(sum(q[:, :, order[i]] << (4 * i) for i in range(8)))


def _to_int32(packed: torch.Tensor) -> torch.Tensor:
    return torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)


def pack_rows(q: torch.Tensor) -> torch.Tensor:
    """int [R, C] -> int32 [R/8, C]: nibble i of row r holds input row 8r + i (GPTQ's qweight)."""
    q = q.reshape(-1, 8, q.shape[1]).long()
    return _to_int32(sum(q[:, i, :] << (4 * i) for i in range(8)))


def quantize(weight: torch.Tensor, fmt: str, gen: torch.Generator):
    """A float weight [N, K] (out, in) -> (checkpoint tensors, the dequantized [N, K] weight)."""
    w = weight.t().double()  # [K, N]: both formats store input rows first
    k, n = w.shape
    groups = torch.arange(k) // GROUP
    if fmt == "gptq":  # act-order: the groups are taken in a permuted order of the input rows
        perm = torch.randperm(k, generator=gen)
        groups = torch.empty(k, dtype=torch.long)
        groups[perm] = torch.arange(k) // GROUP
    lo = torch.stack([w[groups == g].min(0).values for g in range(k // GROUP)])  # [G, N]
    hi = torch.stack([w[groups == g].max(0).values for g in range(k // GROUP)])
    scales = ((hi - lo) / 15).clamp(min=1e-8).to(torch.float16).double()
    zeros = torch.round(-lo / scales).clamp(0, 15)
    q = torch.round(w / scales[groups] + zeros[groups]).clamp(0, 15).long()
    dequantized = ((q - zeros[groups].long()) * scales[groups]).t().float()  # [N, K]
    if fmt == "awq":
        tensors = {"qweight": pack_columns(q, AWQ_ORDER), "qzeros": pack_columns(zeros.long(), AWQ_ORDER),
                   "scales": scales.to(torch.float16)}
    else:
        tensors = {"qweight": pack_rows(q), "qzeros": pack_columns(zeros.long() - 1), "scales": scales.to(torch.float16),
                   "g_idx": groups.to(torch.int32)}
    return tensors, dequantized


CONFIGS = {
    "awq": {"quant_method": "awq", "bits": 4, "group_size": GROUP, "zero_point": True, "version": "gemm"},
    "gptq": {"quant_method": "gptq", "bits": 4, "group_size": GROUP, "desc_act": True, "sym": False,
             "checkpoint_format": "gptq"},
}


@pytest.mark.parametrize("fmt", ["awq", "gptq"])
def test_int4_checkpoint_loads_and_equals_its_dequantized_model(fmt, tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=256, hidden_size=256, intermediate_size=384, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    model.save_pretrained(tmp_path)
    state = load_file(tmp_path / "model.safetensors")
    gen = torch.Generator().manual_seed(1)
    packed = {}
    for name, tensor in state.items():
        if name.startswith("model.layers.") and name.endswith("_proj.weight"):
            tensors, dequantized = quantize(tensor, fmt, gen)
            packed.update({name.removesuffix("weight") + key: value.contiguous() for key, value in tensors.items()})
            model.get_parameter(name).data.copy_(dequantized)  # the reference: same model, dequantized weights
        else:
            packed[name] = tensor
    save_file(packed, tmp_path / "model.safetensors")
    written = json.loads((tmp_path / "config.json").read_text())
    written["quantization_config"] = CONFIGS[fmt]
    (tmp_path / "config.json").write_text(json.dumps(written))

    llm = LLM(str(tmp_path), dtype="float32", device="cpu", num_kv_blocks=16)
    assert llm.engine.quantization.name == fmt and llm.engine.weight_bytes["int32"] > 0
    prompt = [3, 17, 42, 99, 7, 200]
    out = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
                       use_tqdm=False)[0].outputs[0].token_ids
    ids = torch.tensor([prompt])
    with torch.no_grad():
        want = model.generate(ids, max_new_tokens=12, do_sample=False, min_new_tokens=12)[0, len(prompt):].tolist()
    assert out == want


def test_int4_layer_against_a_plain_reference():
    """One GPTQ act-order layer: Podium's unpacking equals the test's dequantization exactly."""
    from podium.quantization.int4 import Int4Linear

    gen = torch.Generator().manual_seed(2)
    weight = torch.randn(64, 256, generator=gen)
    tensors, dequantized = quantize(weight, "gptq", gen)
    layer = Int4Linear(256, 64, False, GROUP, "gptq")
    for key, value in tensors.items():
        getattr(layer, key).data = value if key != "scales" else value.float()
    x = torch.randn(3, 256, generator=gen)
    torch.testing.assert_close(layer.dequantized(torch.float32), dequantized.t(), rtol=0, atol=0)
    torch.testing.assert_close(layer(x), x @ dequantized.t(), rtol=1e-5, atol=1e-5)


def test_quantized_layers_declare_the_op_they_compute_with():
    """The contract's quantized_call: the op named and its arguments reproduce the layer's own output, for
    the INT4 and FP8 layers (what a platform's fused norm + linear calls in its place)."""
    from podium.quantization.fp8 import Fp8Linear, quantize_weight
    from podium.quantization.int4 import Int4Linear
    from podium_plugin_api.ops import REFERENCE_OPS
    from podium_plugin_api.quantization import quantized_call

    gen = torch.Generator().manual_seed(3)
    x = torch.randn(3, 256, generator=gen)
    int4 = Int4Linear(256, 64, True, GROUP, "gptq")
    for key, value in quantize(torch.randn(64, 256, generator=gen), "gptq", gen)[0].items():
        getattr(int4, key).data = value if key != "scales" else value.float()
    int4.bias.data = torch.randn(64, generator=gen)
    fp8 = Fp8Linear(256, 64, True, "channel", REFERENCE_OPS)
    fp8.weight.data, fp8.weight_scale.data = quantize_weight(torch.randn(64, 256, generator=gen))
    fp8.bias.data = torch.randn(64, generator=gen)
    for layer, name in ((int4, "int4_linear"), (fp8, "fp8_linear")):
        op, args = quantized_call(layer)
        assert op == name
        torch.testing.assert_close(REFERENCE_OPS[op](x, *args), layer(x), rtol=0, atol=0)
    assert quantized_call(nn.Linear(4, 4)) is None


def test_unsupported_int4_configs_are_refused():
    from podium.quantization import select_quantization

    with pytest.raises(ValueError, match="8-bit weights are not supported"):
        select_quantization(None, {"quant_method": "gptq", "bits": 8, "group_size": 128})
    with pytest.raises(ValueError, match="version gemm"):
        select_quantization(None, {"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemv"})


def test_online_awq_rounds_a_float_model_to_nearest_and_generates(tmp_path):
    """quantization="awq" on a tiny float Llama: every decoder linear becomes an AWQ layer (the head stays
    float) whose weights, unpacked by this test's own reference, lie within a group scale of the float
    ones (half of one, but at the group's ends the zero point's rounding and the clamp to 0..15); the engine's greedy tokens equal transformers' on the model with those weights."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from podium.quantization.int4 import Int4Linear

    config = LlamaConfig(vocab_size=256, hidden_size=256, intermediate_size=384, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    model.save_pretrained(tmp_path)
    llm = LLM(str(tmp_path), dtype="float32", device="cpu", quantization="awq", num_kv_blocks=16)
    layers = llm.engine.model.model.layers
    assert isinstance(layers[0].self_attn.qkv_proj, Int4Linear) and type(llm.engine.model.lm_head) is not Int4Linear
    for i, layer in enumerate(model.model.layers):
        for hf, ours, rows in (("self_attn.q_proj", "self_attn.qkv_proj", slice(0, 256)),
                               ("self_attn.k_proj", "self_attn.qkv_proj", slice(256, 384)),
                               ("self_attn.v_proj", "self_attn.qkv_proj", slice(384, 512)),
                               ("self_attn.o_proj", "self_attn.o_proj", slice(None)),
                               ("mlp.gate_proj", "mlp.gate_up_proj", slice(0, 384)),
                               ("mlp.up_proj", "mlp.gate_up_proj", slice(384, 768)),
                               ("mlp.down_proj", "mlp.down_proj", slice(None))):
            packed = layers[i].get_submodule(ours)
            q = unpack_awq(packed.qweight)[:, rows]  # [K, n]
            z = unpack_awq(packed.qzeros)[:, rows]
            s = packed.scales[:, rows].double()
            groups = torch.arange(q.shape[0]) // GROUP
            weight = ((q - z[groups]) * s[groups]).t()  # [n, K]
            float_weight = layer.get_submodule(hf).weight
            assert ((weight - float_weight.double()).abs() <= s[groups].t() + 1e-6).all()
            float_weight.data.copy_(weight.float())
    prompt = [3, 17, 42, 99, 7, 200]
    out = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
                       use_tqdm=False)[0].outputs[0].token_ids
    with torch.no_grad():
        want = model.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False,
                              min_new_tokens=12)[0, len(prompt):].tolist()
    assert out == want


def unpack_awq(packed: torch.Tensor) -> torch.Tensor:
    """int32 [R, C/8] in AWQ's nibble order -> int64 [R, C] (independent of the code under test)."""
    nibbles = [(packed.long() >> (4 * i)) & 15 for i in range(8)]  # nibble i holds column AWQ_ORDER[i]
    out = torch.empty(packed.shape[0], packed.shape[1], 8, dtype=torch.long)
    for i, column in enumerate(AWQ_ORDER):
        out[:, :, column] = nibbles[i]
    return out.reshape(packed.shape[0], -1)


def test_the_awq_mma_layout_holds_each_nibble_where_the_contract_says():
    """AWQ_MMA (the layout a platform may convert AWQ weights to, podium_plugin_api.int4): every nibble read
    by the documented formula, element by element, against the plain weight; the inverse; the dequantized
    weight and the reference layer equal AWQ's; shapes without whole tiles refused."""
    from podium_plugin_api.int4 import (
        AWQ,
        AWQ_MMA,
        MMA_K_OF_NIBBLE,
        awq_to_mma,
        dequantize,
        int4_linear,
        pack_mma,
        packed_shape,
        random_packed,
        unpack_columns,
        unpack_mma,
    )

    gen = torch.Generator().manual_seed(5)
    packed = random_packed(AWQ, 128, 32, 64, False, gen)
    q = unpack_columns(packed["qweight"], awq=True)
    words = awq_to_mma(packed["qweight"])
    assert words.shape == (2, 2, 32, 4) and words.dtype == torch.int32 and packed_shape(words, AWQ_MMA) == (128, 32)
    for t, s, lane, u, i in itertools.product(range(2), range(2), range(32), range(4), range(8)):
        nibble = (int(words[t, s, lane, u]) >> (4 * i)) & 15
        k, n = 64 * s + 16 * (lane % 4) + 4 * u + MMA_K_OF_NIBBLE[i], 16 * t + lane // 4 + 8 * (i % 2)
        assert nibble == q[k, n], (t, s, lane, u, i)
    assert torch.equal(unpack_mma(words), q) and torch.equal(pack_mma(q), words)
    as_awq = dequantize(packed["qweight"], packed["qzeros"], packed["scales"], None, 64, AWQ)
    assert torch.equal(dequantize(words, packed["qzeros"], packed["scales"], None, 64, AWQ_MMA), as_awq)
    x = torch.randn(3, 128, generator=gen)
    assert torch.equal(int4_linear(x, words, packed["qzeros"], packed["scales"], None, 64, AWQ_MMA),
                       int4_linear(x, packed["qweight"], packed["qzeros"], packed["scales"], None, 64, AWQ))
    with pytest.raises(ValueError, match="multiple of 64"):
        pack_mma(torch.zeros(96, 16, dtype=torch.int64))
    with pytest.raises(ValueError, match="of 16"):
        awq_to_mma(torch.zeros(128, 3, dtype=torch.int32))
    with pytest.raises(ValueError, match="not one the contract defines"):
        packed_shape(words, "marlin")
