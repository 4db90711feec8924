"""LoRA composed with the model's other transformations: tensor parallelism (TP=2 equals TP=1 with
adapters on CPU processes over gloo: column-parallel projections shard lora_B by output rows,
row-parallel ones lora_A by input columns, their partial sums joining the all-reduce) and quantized
base linears (SmolLM2's GGUF kept in its Q4_1 blocks, against PEFT on transformers' dequantized load
of the same file; a tiny model quantized online to FP8 W8A8 and to AWQ INT4, against PEFT on the
transformers model given the engine's dequantized weights, and each of its adapted projections
against the quantized layer's own output plus PEFT's delta computed here in float64)."""

from __future__ import annotations

import copy

import pytest
import torch
from lora_fixtures import ALL_TARGETS, make_adapter, peft_greedy
from model_fixtures import ARCHITECTURES, save_tiny_model

from podium import LLM, SamplingParams
from podium.lora.request import LoRARequest

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::UserWarning")

ENGINE = {"dtype": "float32", "device": "cpu", "block_size": 4, "max_num_seqs": 6, "max_num_batched_tokens": 24,
          "num_kv_blocks": 48, "enforce_eager": True, "max_model_len": 64, "enable_lora": True, "max_lora_rank": 8,
          "max_loras": 2}


def run(folder, tp: int, requests: list, prompts: list[list[int]]):
    llm = LLM(str(folder), tensor_parallel_size=tp, **ENGINE)
    try:
        params = SamplingParams(max_tokens=8, temperature=0.0, logprobs=3, ignore_eos=True)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, lora_request=requests, use_tqdm=False)
        return [o.outputs[0] for o in outs]
    finally:
        llm.engine.shutdown()


@pytest.mark.parametrize("arch", ["llama3-rope-untied", "llama-bias-linear-rope"])
def test_tp2_with_adapters_equals_tp1(arch, tmp_path):
    """Three adapters (more than the two slots) and the base model mixed; the second model has one KV
    head, replicated over both ranks (its k/v lora_B rows are the same on each)."""
    model_type, overrides = ARCHITECTURES[arch]
    save_tiny_model(model_type, overrides, tmp_path / "base")
    peft_models = [make_adapter(tmp_path / "base", tmp_path / f"a{i}", seed=i, targets=ALL_TARGETS[:4 + i])
                   for i in range(3)]
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(1, 90, (n,), generator=g).tolist() for n in (5, 30, 9, 17, 2, 12)]
    adapters = [LoRARequest(f"a{i}", i + 1, str(tmp_path / f"a{i}")) for i in range(3)]
    requests = [adapters[0], None, adapters[1], adapters[2], adapters[0], adapters[1]]
    ref = run(tmp_path / "base", 1, requests, prompts)
    got = run(tmp_path / "base", 2, requests, prompts)
    for i, (a, b, request) in enumerate(zip(ref, got, requests)):
        assert b.token_ids == a.token_ids, f"prompt {i}: TP=2 {b.token_ids} != TP=1 {a.token_ids}"
        worst = max(abs(sa[t].logprob - sb[t].logprob) for sa, sb in zip(a.logprobs, b.logprobs) for t in sa)
        assert worst < 1e-4, f"prompt {i}: logprobs differ by {worst}"
        if request is not None:
            assert a.token_ids == peft_greedy(peft_models[int(request.lora_name[1])], prompts[i], 8)


NEAR_TIE = 0.5  # nats: the kept GGUF kernels quantize activations to int8 per block, as llama.cpp does
# (seen: 0.34 at a flip with this adapter; a wrong or missing adapter moves the top token by nats)


def _equal_up_to_a_near_tie(peft_model, prompt: list[int], ours: list[int]) -> None:
    """Our greedy tokens are PEFT's, or follow them up to a position where PEFT itself ranks our
    token within NEAR_TIE of its own (a flip the kernels' activation rounding may cause)."""
    want = peft_greedy(peft_model, prompt, len(ours))
    position = next((i for i, (a, b) in enumerate(zip(ours, want)) if a != b), None)
    if position is None:
        return
    with torch.inference_mode():
        logits = peft_model(torch.tensor([prompt + want[:position]])).logits[0, -1].log_softmax(-1)
    margin = float(logits[want[position]] - logits[ours[position]])
    assert margin < NEAR_TIE, f"token {position}: {ours[position]} for PEFT's {want[position]}, {margin:.3f} nats below"


def test_quantized_gguf_base_with_an_adapter_equals_peft_on_the_dequantized_model(tmp_path):
    """SmolLM2's Q4_1 GGUF run with its blocks kept (quantization="gguf"): the adapter wraps the
    quantized linears; transformers loads the same file dequantized and PEFT adapts it (greedy
    tokens equal, or apart only after a near-tie)."""
    from engine_fixtures import smollm2_gguf
    from transformers import AutoModelForCausalLM

    path = smollm2_gguf()
    base = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    peft_model = make_adapter(base, tmp_path / "adapter", seed=3, scale=1.0)
    llm = LLM(str(path), dtype="float32", device="cpu", quantization="gguf", enable_lora=True, max_lora_rank=8,
              max_model_len=256, enforce_eager=True)
    prompts = [[1, 4093, 314, 253, 1345, 30], [504, 3458, 282, 4649, 314]]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False,
                        lora_request=LoRARequest("a", 1, str(tmp_path / "adapter")))
    for prompt, out in zip(prompts, outs):
        _equal_up_to_a_near_tie(peft_model, prompt, out.outputs[0].token_ids)
    with peft_model.disable_adapter():
        assert peft_greedy(peft_model, prompts[0], 6) != outs[0].outputs[0].token_ids, "the adapter changed nothing"


# every decoder linear splits into AWQ's groups of 128 inputs (hidden 128, intermediate 256, q 128, k/v 64)
QUANTIZABLE = {"hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2, "tie_word_embeddings": False}
LINEARS = (("self_attn.q_proj", "self_attn.qkv_proj", slice(0, 128)),
           ("self_attn.k_proj", "self_attn.qkv_proj", slice(128, 192)),
           ("self_attn.v_proj", "self_attn.qkv_proj", slice(192, 256)),
           ("self_attn.o_proj", "self_attn.o_proj", slice(None)),
           ("mlp.gate_proj", "mlp.gate_up_proj", slice(0, 256)),
           ("mlp.up_proj", "mlp.gate_up_proj", slice(256, 512)),
           ("mlp.down_proj", "mlp.down_proj", slice(None)))


def _fp8_per_token(module, args):
    """FP8 W8A8's activation rounding, written here: each row scaled to max |x| = 448, rounded to e4m3, scaled back."""
    x = args[0]
    amax = x.abs().amax(dim=-1, keepdim=True)
    scale = torch.where(amax > 0, amax / torch.full_like(amax, 448.0), torch.ones_like(amax))
    return ((x / scale).clamp(-448.0, 448.0).to(torch.float8_e4m3fn).float() * scale,)


def _dequantized(layer, method: str) -> torch.Tensor:
    """The weight [N, K] the engine's quantized layer holds: fp8 times its per-channel scale, or INT4
    unpacked by the layer (``Int4Linear.dequantized``; tests/test_int4.py checks it against its own unpacking)."""
    from podium.quantization.fp8 import Fp8Linear
    from podium.quantization.int4 import Int4Linear

    kind = Fp8Linear if method == "fp8" else Int4Linear
    assert isinstance(layer, kind), f"{method}: the adapted projection wraps {type(layer).__name__}, not {kind.__name__}"
    if method == "fp8":
        return layer.weight.float() * layer.weight_scale
    return layer.dequantized(torch.float32).t()


@pytest.mark.parametrize("method", ["fp8", "awq"])
def test_online_quantized_base_with_an_adapter_equals_peft_on_its_dequantized_weights(method, tmp_path):
    """quantization="fp8" (per-channel weights, per-token activations) and "awq" (INT4, groups of 128)
    online: every decoder linear quantized, each wrapped by its LoRA projection. The reference is PEFT
    on the transformers model whose linears hold the engine's dequantized weights (for FP8 also
    rounding their inputs per token as W8A8 does; the adapter's branch reads the unrounded input, as
    the engine's does): greedy tokens equal and chosen logprobs within 1e-4 (FP8: 1e-3), for two adapters and the
    base model mixed in one batch."""
    from lora_fixtures import ALL_TARGETS

    from podium.lora.layers import LoRALinear

    model_type, overrides = ARCHITECTURES["llama3-rope-untied"]
    hf = save_tiny_model(model_type, {**overrides, **QUANTIZABLE}, tmp_path / "base")
    llm = LLM(str(tmp_path / "base"), quantization=method, **ENGINE)
    layers = llm.engine.model.model.layers
    with torch.no_grad():
        for ours, theirs in zip(layers, hf.model.layers):
            for hf_name, name, rows in LINEARS:
                adapted = ours.get_submodule(name)
                assert isinstance(adapted, LoRALinear)
                target = theirs.get_submodule(hf_name)
                target.weight.copy_(_dequantized(adapted.base, method)[rows])
                if method == "fp8":
                    target.register_forward_pre_hook(_fp8_per_token)
    # each adapter on its own copy (PEFT wraps the hooked linears in place); the base model is hf itself
    references = [make_adapter(copy.deepcopy(hf), tmp_path / f"a{i}", seed=i + 5, targets=ALL_TARGETS, scale=1.0)
                  for i in range(2)] + [hf]
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(1, 90, (n,), generator=g).tolist() for n in (7, 19, 4)]
    requests = [LoRARequest(f"a{i}", i + 1, str(tmp_path / f"a{i}")) for i in range(2)] + [None]
    params = SamplingParams(max_tokens=8, temperature=0.0, logprobs=1, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, lora_request=requests, use_tqdm=False)
    for prompt, reference, out in zip(prompts, references, outs):
        got, want = out.outputs[0], peft_greedy(reference, prompt, 8)
        assert got.token_ids == want, f"{method}: {got.token_ids} != PEFT's {want}"
        with torch.inference_mode():
            logits = reference(torch.tensor([prompt + want])).logits[0]
        steps = torch.log_softmax(logits[len(prompt) - 1:-1].float(), dim=-1)
        worst = max(abs(step[t].logprob - float(steps[i, t])) for i, (step, t) in enumerate(zip(got.logprobs, want)))
        # W8A8 rounds each activation to e4m3 (3 mantissa bits): an element within a few millionths of a
        # step of a rounding tie goes either way on a last-bit difference upstream (attention summed in
        # another order on another CPU kind), a whole step for that element. Seen: 3.7e-4 on an AVX2 EPYC
        # with one element 2.9e-6 of a step from the tie; INT4 rounds only the weights, which are shared.
        tolerance = 1e-3 if method == "fp8" else 1e-4
        assert worst < tolerance, f"{method}: logprobs differ from PEFT's by {worst}"
    assert peft_greedy(hf, prompts[0], 8) != outs[0].outputs[0].token_ids, "the adapter changed nothing"


def _peft_delta(folder, layer: int, hf_name: str) -> torch.Tensor:
    """PEFT's delta weight for one target, written here from the saved files: scaling * B @ A [n, K]
    in float64, scaling = lora_alpha / r (the fixture's adapters use neither rsLoRA nor patterns)."""
    import json

    from safetensors.torch import load_file

    config = json.loads((folder / "adapter_config.json").read_text())
    assert not config["use_rslora"] and not config["rank_pattern"] and not config["alpha_pattern"]
    tensors = load_file(str(folder / "adapter_model.safetensors"))
    prefix = f"base_model.model.model.layers.{layer}.{hf_name}"
    a, b = tensors[f"{prefix}.lora_A.weight"].double(), tensors[f"{prefix}.lora_B.weight"].double()
    return config["lora_alpha"] / config["r"] * b @ a


@pytest.mark.parametrize("method", ["fp8", "awq"])
def test_a_quantized_projection_adds_the_adapters_delta_to_its_own_output(method, tmp_path):
    """Layer by layer, independent of the PEFT model: each adapted FP8 / INT4 projection's output is the
    quantized base layer's own output plus, for each row with a slot, PEFT's delta (scaling * B @ A, read
    from the adapter's files, merged projections as the concatenation of their parts) applied to the
    unrounded input, in float64. Rows of two adapters and rows of none in one call."""
    import numpy as np

    from podium.lora.layers import LoRALinear

    model_type, overrides = ARCHITECTURES["llama3-rope-untied"]
    save_tiny_model(model_type, {**overrides, **QUANTIZABLE}, tmp_path / "base")
    folders = [tmp_path / f"a{i}" for i in range(2)]
    for i, folder in enumerate(folders):
        make_adapter(tmp_path / "base", folder, seed=i + 7, targets=ALL_TARGETS, alpha=8 * (i + 1), scale=1.0)
    llm = LLM(str(tmp_path / "base"), quantization=method, **ENGINE)
    try:
        step = llm.engine.shard.lora
        step.load([(slot, llm.engine.load_lora(f"a{slot}", str(folder))) for slot, folder in enumerate(folders)])
        row_slots = np.array([0, -1, 1, 1, 0, -1, 0], dtype=np.int32)
        step.state.stage(row_slots, None)
        g = torch.Generator().manual_seed(9)
        merged: dict[str, list[tuple[str, slice]]] = {}
        for hf_name, name, rows in LINEARS:
            merged.setdefault(name, []).append((hf_name, rows))
        with torch.inference_mode():
            for index, layer in enumerate(llm.engine.model.model.layers):
                for name, parts in merged.items():
                    adapted = layer.get_submodule(name)
                    assert isinstance(adapted, LoRALinear)
                    _dequantized(adapted.base, method)  # (asserts the quantized kind)
                    x = torch.randn(len(row_slots), adapted.in_features, generator=g)
                    want = adapted.base(x).double()
                    for slot, folder in enumerate(folders):
                        delta = torch.cat([_peft_delta(folder, index, hf_name) for hf_name, _ in parts])
                        mine = torch.from_numpy(row_slots == slot)
                        want[mine] += x[mine].double() @ delta.t()
                    got = adapted(x).double()
                    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5,
                                               msg=lambda m, i=index, n=name: f"{method} layer {i} {n}: {m}")
                    added = got - adapted.base(x).double()
                    assert added[row_slots < 0].eq(0).all() and added[row_slots >= 0].abs().amax() > 1e-2
    finally:
        llm.engine.shutdown()
