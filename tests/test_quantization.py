"""Quantization as a transformation: the method registry, the GGUF method on the real SmolLM2 Q4_1
file (greedy tokens against the dequantized path, weight memory against the file's packed bytes),
and a plugin's method replacing a built-in one."""

from __future__ import annotations

import pytest
import torch
from engine_fixtures import GOLDEN_CHATS, GOLDEN_PROMPTS, smollm2_gguf
from torch import nn

from podium import LLM, SamplingParams
from podium.loader.gguf_reader import read_gguf
from podium.quantization import quantization_methods, select_quantization
from podium.quantization.gguf import GGUFEmbedding, GGUFLinear, GGUFMethod
from podium_plugin_api.quantization import QuantizationMethod

NUM_TOKENS = 48


@pytest.fixture(scope="module")
def engines():
    kept = LLM("smollm2-135m-instruct", dtype="float32", device="cpu", quantization="gguf")
    plain = LLM("smollm2-135m-instruct", dtype="float32", device="cpu")
    return kept, plain


def _prompts(tok) -> list[list[int]]:
    ids = [tok.encode(p) for p in GOLDEN_PROMPTS]
    for chat in GOLDEN_CHATS:
        out = tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=True)
        ids.append(list(out["input_ids"]) if hasattr(out, "keys") else list(out))
    return ids


NEAR_TIE = 0.3  # nats: the largest margin a flip was seen at (0.22); a wrong kernel's logits are far off


def test_smollm2_q4_1_kept_quantized_follows_the_dequantized_path_up_to_near_ties(engines):
    """float32. The CPU block kernels quantize activations to int8 per 32 values, as llama.cpp does, so
    greedy tokens may flip where the dequantized path's top two are nearly tied: each prompt's tokens
    equal the dequantized path's up to its first difference, and there the dequantized path ranks the
    kept path's token within NEAR_TIE of its own (measured: 9 of 12 prompts flip, at margins of
    0.01-0.22 nats; the bf16 dequantized path flips 8 of 12 against float32, at up to 0.14)."""
    kept, plain = engines
    assert isinstance(kept.engine.model.model.layers[0].self_attn.qkv_proj, GGUFLinear)
    assert isinstance(kept.engine.model.model.embed_tokens, GGUFEmbedding)
    assert kept.engine.model.lm_head.weight is kept.engine.model.model.embed_tokens.weight  # tied, one copy
    prompts = [{"prompt_token_ids": p} for p in _prompts(kept.get_tokenizer())]
    params = SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True, logprobs=5)
    got = [o.outputs[0] for o in kept.generate(prompts, params, use_tqdm=False)]
    want = [o.outputs[0] for o in plain.generate(prompts, params, use_tqdm=False)]
    flips = 0
    for g, w in zip(got, want):
        first = next((i for i, (a, b) in enumerate(zip(g.token_ids, w.token_ids)) if a != b), None)
        if first is None:
            continue
        flips += 1
        top = w.logprobs[first]
        ours = top.get(g.token_ids[first])
        assert ours is not None and top[w.token_ids[first]].logprob - ours.logprob < NEAR_TIE, (
            f"the kept path's token {g.token_ids[first]} at step {first} is not a near-tie of the dequantized "
            f"path's {w.token_ids[first]}: {top}")
    assert flips < len(prompts)  # most prompts' 48 tokens agree somewhere, and some wholly


def test_weight_memory_is_the_files_packed_size(engines):
    """Every weight tensor of the file is held once: packed uint8 blocks plus the float32 norms, within
    1.1x of the bytes the GGUF file stores (and ~5x less than the dequantized float32 model)."""
    kept, plain = engines
    gguf = read_gguf(smollm2_gguf())
    stored = sum(gguf.raw(info).nbytes for info in gguf.tensors.values())
    held = sum(kept.engine.weight_bytes.values())
    assert kept.engine.weight_bytes["uint8"] > 0.9 * held
    assert held <= 1.1 * stored, (held, stored)
    assert sum(plain.engine.weight_bytes.values()) > 4 * held


def test_a_gguf_file_keeps_its_blocks_when_asked():
    types = {"model.layers.0.mlp.down_proj.weight": 3}
    checkpoint = {"quant_method": "gguf", "tensor_types": types}
    assert isinstance(select_quantization("gguf", checkpoint), GGUFMethod)
    assert select_quantization(None, checkpoint) is None  # dequantized at load unless asked (registry docstring)
    assert select_quantization("none", checkpoint) is None
    assert select_quantization(None, None) is None
    with pytest.raises(ValueError, match="quantized with 'gguf'"):
        select_quantization("fp8", checkpoint)
    with pytest.raises(ValueError, match="not a known method"):
        select_quantization("int3", None)
    with pytest.raises(ValueError, match="no installed quantization method reads"):
        select_quantization(None, {"quant_method": "bitnet"})
    with pytest.raises(ValueError, match="cannot quantize a float checkpoint"):
        select_quantization("gguf", None)


class VendorGGUF(GGUFMethod):
    """A vendor's GGUF method: the built-in layers, marked so the test can see it ran."""

    applied = 0

    def apply(self, model: nn.Module, ops) -> None:
        VendorGGUF.applied += 1
        super().apply(model, ops)


class VendorFormat(QuantizationMethod):
    name = "vendor-int3"
    checkpoint_names = ("vendor_int3",)


def test_a_plugin_method_replaces_a_builtin_and_adds_a_format():
    methods = quantization_methods({"gguf": VendorGGUF, "vendor-int3": VendorFormat})
    assert methods["gguf"] is VendorGGUF and methods["vendor-int3"] is VendorFormat
    chosen = select_quantization(None, {"quant_method": "vendor_int3"}, {"vendor-int3": VendorFormat})
    assert isinstance(chosen, VendorFormat)
    with pytest.raises(ValueError, match="not a QuantizationMethod subclass"):
        quantization_methods({"bad": object})


def test_a_plugin_method_runs_through_the_engine(monkeypatch):
    """The engine asks the plugins (podium_quantization_methods) and builds the model with theirs."""
    from podium_plugin_api import discovery

    monkeypatch.setattr(discovery.Plugins, "quantization_methods", lambda self: {"gguf": VendorGGUF})
    VendorGGUF.applied = 0
    llm = LLM("smollm2-135m-instruct", dtype="float32", device="cpu", num_kv_blocks=16, max_model_len=64,
              enforce_eager=True, quantization="gguf")
    assert VendorGGUF.applied == 1 and isinstance(llm.engine.quantization, VendorGGUF)
    out = llm.generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4


def test_mixed_block_types_in_a_merged_projection_load_by_part():
    """q/k in Q4_K and v in Q6_K (how Q4_K_M files store them): the merged q|k|v splits into parts,
    each loaded from its own checkpoint rows."""
    from types import SimpleNamespace

    from podium.models.layers import Attention
    from podium.models.weights import load_hf_weights
    from podium_plugin_api.gguf_blocks import Q4_K, Q6_K, dequantize_rows, random_rows
    from podium_plugin_api.ops import build_op_table

    config = SimpleNamespace(num_attention_heads=2, num_key_value_heads=1, hidden_size=256, head_dim=128,
                             rms_norm_eps=1e-6, sliding_window=None)
    ops = build_op_table()
    with torch.device("meta"):
        holder = nn.Module()
        holder.self_attn = Attention(config, 0, ops, qkv_bias=False, o_bias=False, qk_norm=False)
    types = {"self_attn.q_proj.weight": Q4_K, "self_attn.k_proj.weight": Q4_K, "self_attn.v_proj.weight": Q6_K,
             "self_attn.o_proj.weight": Q4_K}
    method = GGUFMethod({"tensor_types": types})
    method.apply(holder, ops)
    holder = holder.to_empty(device="cpu")
    gen = torch.Generator().manual_seed(0)
    tensors = {"self_attn.q_proj.weight": random_rows(Q4_K, 256, 256, gen),
               "self_attn.k_proj.weight": random_rows(Q4_K, 128, 256, gen),
               "self_attn.v_proj.weight": random_rows(Q6_K, 128, 256, gen),
               "self_attn.o_proj.weight": random_rows(Q4_K, 256, 256, gen)}
    load_hf_weights(holder, tensors.items())
    x = torch.randn(3, 256, generator=gen)
    dense = torch.cat([dequantize_rows(tensors[f"self_attn.{n}_proj.weight"], types[f"self_attn.{n}_proj.weight"])
                       for n in "qkv"])
    torch.testing.assert_close(holder.self_attn.qkv_proj(x), x @ dense.t(), rtol=1e-5, atol=1e-4)


# --- FP8 W8A8 ----------------------------------------------------------------------------------

def _fp8_reference(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, block: int | None) -> torch.Tensor:
    """W8A8 in float64, written here: per-token activation scale amax/448, x rounded to e4m3 by torch's
    cast, weights q * s with s per tensor, per row, or per 128 x 128 block."""
    amax = x.double().abs().amax(dim=-1, keepdim=True)
    s_x = torch.where(amax > 0, amax / 448.0, torch.ones_like(amax))
    xq = (x.double() / s_x).to(torch.float8_e4m3fn).double()
    w = q.double()
    if block:
        for i in range(0, w.shape[0], block):
            for j in range(0, w.shape[1], block):
                w[i:i + block, j:j + block] *= float(scale[i // block, j // block])
    else:
        w = w * scale.double().reshape(-1, 1) if scale.numel() > 1 else w * float(scale)
    return (xq @ w.t()) * s_x


@pytest.mark.parametrize("granularity", ["tensor", "channel", "block"])
def test_fp8_linear_against_a_float64_reference(granularity):
    from podium_plugin_api.fp8 import fp8_linear

    gen = torch.Generator().manual_seed(1)
    n, k = 200, 300  # not multiples of the 128 blocks
    q = (torch.randn(n, k, generator=gen) * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
    shapes = {"tensor": (1,), "channel": (n, 1), "block": (2, 3)}
    scale = torch.rand(shapes[granularity], generator=gen) * 0.01 + 0.001
    x = torch.randn(5, k, generator=gen)
    x[3] = 0.0  # an all-zero token: scale 1, output 0
    got = fp8_linear(x, q, scale)
    want = _fp8_reference(x, q, scale, 128 if granularity == "block" else None)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5 * want.abs().max().item())
    assert torch.count_nonzero(got[3]) == 0


def test_online_fp8_quantizes_a_float_model_and_generates(tmp_path):
    """quantization="fp8" on a tiny float Llama: every decoder linear becomes fp8 (the head stays float),
    weights within fp8 rounding of the float ones, and greedy decoding runs."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from podium.quantization.fp8 import FP8, Fp8Linear  # noqa: F401

    config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(tmp_path)
    llm = LLM(str(tmp_path), dtype="float32", device="cpu", quantization="fp8", num_kv_blocks=16)
    plain = LLM(str(tmp_path), dtype="float32", device="cpu", num_kv_blocks=16)
    layer = llm.engine.model.model.layers[0]
    assert isinstance(layer.self_attn.qkv_proj, Fp8Linear) and layer.self_attn.qkv_proj.weight.dtype == FP8
    assert type(llm.engine.model.lm_head) is not Fp8Linear
    plain_down = plain.engine.model.model.layers[0].mlp.down_proj
    # a platform may keep only its packed copy of a plain linear (the CPU's native kernels: unpacked())
    fp8, ref = layer.mlp.down_proj, plain_down.unpacked() if hasattr(plain_down, "unpacked") else plain_down.weight
    dequantized = fp8.weight.float() * fp8.weight_scale
    assert (dequantized - ref).abs().max() <= ref.abs().amax(dim=1, keepdim=True).max() / 16  # e4m3: 3 mantissa bits
    assert llm.engine.weight_bytes["float8_e4m3fn"] > 0
    out = llm.generate([{"prompt_token_ids": [1, 5, 9]}], SamplingParams(temperature=0, max_tokens=6), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 6


def test_unsupported_fp8_checkpoints_are_refused_with_the_reason():
    with pytest.raises(ValueError, match="static activation scales"):
        select_quantization(None, {"quant_method": "fp8", "activation_scheme": "static"})
    with pytest.raises(ValueError, match="weight_block_size"):
        select_quantization(None, {"quant_method": "fp8", "weight_block_size": [64, 64]})
    with pytest.raises(ValueError, match="float8"):
        select_quantization(None, {"quant_method": "compressed-tensors",
                                   "config_groups": {"g": {"weights": {"num_bits": 4, "type": "int"}}}})


def _fp8_checkpoint(tmp_path, kind: str):
    """A tiny Llama saved, then its decoder linears quantized by this test into an fp8 checkpoint:
    ``block`` (quant_method fp8, weight_block_size [128, 128], weight_scale_inv) or compressed-tensors
    ``channel`` / ``tensor``. Returns (the transformers model with the dequantized weights, tensors written)."""
    import json

    from safetensors.torch import load_file, save_file
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=256, hidden_size=256, intermediate_size=384, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    model.save_pretrained(tmp_path)
    state, out = load_file(tmp_path / "model.safetensors"), {}
    for name, w in state.items():
        if not (name.startswith("model.layers.") and name.endswith("_proj.weight")):
            out[name] = w
            continue
        if kind == "block":
            blocks = w.reshape(w.shape[0] // 128, 128, w.shape[1] // 128, 128)
            scale = (blocks.abs().amax(dim=(1, 3)) / 448).clamp(min=1e-12)  # [N/128, K/128]
            full = scale.repeat_interleave(128, 0).repeat_interleave(128, 1)
        elif kind == "channel":
            scale = (w.abs().amax(dim=1, keepdim=True) / 448).clamp(min=1e-12)  # [N, 1]
            full = scale
        else:
            scale = (w.abs().amax() / 448).reshape(1)
            full = scale
        q = (w / full).clamp(-448, 448).to(torch.float8_e4m3fn)
        out[name] = q
        out[name.removesuffix("weight") + ("weight_scale_inv" if kind == "block" else "weight_scale")] = scale
        model.get_parameter(name).data.copy_(q.float() * full)
    save_file(out, tmp_path / "model.safetensors")
    written = json.loads((tmp_path / "config.json").read_text())
    if kind == "block":
        written["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic",
                                          "weight_block_size": [128, 128]}
    else:
        written["quantization_config"] = {
            "quant_method": "compressed-tensors", "format": "float-quantized", "ignore": ["lm_head"],
            "config_groups": {"group_0": {"targets": ["Linear"],
                                          "weights": {"num_bits": 8, "type": "float", "strategy": kind,
                                                      "symmetric": True, "dynamic": False},
                                          "input_activations": {"num_bits": 8, "type": "float",
                                                                "strategy": "token", "dynamic": True}}}}
    (tmp_path / "config.json").write_text(json.dumps(written))
    return model, out


@pytest.mark.parametrize("kind", ["block", "channel", "tensor"])
def test_fp8_checkpoints_load_as_written_and_generate(kind, tmp_path):
    """Every fp8 weight and scale lands where the checkpoint says (q/k/v and gate/up as their own parts);
    the first token's logprobs are within W8A8's rounding of transformers' on the dequantized weights."""
    from podium.quantization.fp8 import Fp8Linear as Layer

    model, written = _fp8_checkpoint(tmp_path, kind)
    llm = LLM(str(tmp_path), dtype="float32", device="cpu", num_kv_blocks=16)
    attn = llm.engine.model.model.layers[1].self_attn
    scale_name = "weight_scale_inv" if kind == "block" else "weight_scale"
    for leaf in ("q_proj", "k_proj", "v_proj", "o_proj"):
        layer = getattr(attn, leaf)
        assert isinstance(layer, Layer) and layer.weight.dtype == torch.float8_e4m3fn
        stored = f"model.layers.1.self_attn.{leaf}."
        assert torch.equal(layer.weight.view(torch.uint8), written[stored + "weight"].view(torch.uint8))
        assert torch.equal(layer.scale.reshape(-1), written[stored + scale_name].reshape(-1).float())
    prompt = [3, 17, 42, 99, 7, 200]
    out = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0, max_tokens=4, logprobs=5),
                       use_tqdm=False)[0].outputs[0]
    with torch.no_grad():
        want = torch.log_softmax(model(torch.tensor([prompt])).logits[0, -1].double(), dim=-1)
    for token, entry in out.logprobs[0].items():
        assert abs(entry.logprob - want[token].item()) < 0.05, (token, entry.logprob, want[token].item())


# --- with tensor parallelism -------------------------------------------------------------------

def test_quantized_layers_with_tensor_parallelism_are_refused_naming_both_settings(tmp_path, monkeypatch):
    """parallel.sharding slices float weights only, so a quantization method, asked for or the
    checkpoint's own, is refused with tensor_parallel_size > 1 before any worker starts; a GGUF file
    with quantization unset is dequantized and shards (tests/test_tensor_parallel.py)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from podium import engine

    def no_workers(*args, **kwargs):
        raise AssertionError("a worker started before the refusal")

    monkeypatch.setattr(engine, "start_workers", no_workers)
    with pytest.raises(ValueError, match=r"quantization='gguf' and tensor_parallel_size=3 do not run together.*"
                                         r"tensor_parallel_size=1"):
        LLM("smollm2-135m-instruct", device="cpu", quantization="gguf", tensor_parallel_size=3)

    config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    LlamaForCausalLM(config).save_pretrained(tmp_path / "float")
    with pytest.raises(ValueError, match=r"quantization='fp8' and tensor_parallel_size=2 do not run together"):
        LLM(str(tmp_path / "float"), device="cpu", quantization="fp8", tensor_parallel_size=2)

    _fp8_checkpoint(tmp_path / "fp8", "block")
    with pytest.raises(ValueError, match=r"checkpoint is quantized \(fp8, its quantization_config\).*"
                                         r"tensor_parallel_size=2.*use tensor_parallel_size=1"):
        LLM(str(tmp_path / "fp8"), device="cpu", tensor_parallel_size=2)
