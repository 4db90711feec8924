"""LoRA composed with the model's other transformations: tensor parallelism (TP=2 equals TP=1 with
adapters on CPU processes over gloo: column-parallel projections shard lora_B by output rows,
row-parallel ones lora_A by input columns, their partial sums joining the all-reduce) and quantized
base linears (SmolLM2's GGUF kept in its Q4_1 blocks, against PEFT on transformers' dequantized load
of the same file)."""

from __future__ import annotations

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
