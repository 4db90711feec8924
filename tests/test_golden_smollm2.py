"""Golden test: Podium's greedy tokens equal transformers' on the real SmolLM2 GGUF, float32."""

from __future__ import annotations

import pytest
import torch
from engine_fixtures import GOLDEN_CHATS, GOLDEN_PROMPTS, smollm2_gguf

from podium import LLM, SamplingParams

NUM_TOKENS = 48


@pytest.fixture(scope="module")
def hf_model_and_tokenizer():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = smollm2_gguf()
    tok = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    return model.eval(), tok


@pytest.fixture(scope="module")
def llm():
    return LLM("smollm2-135m-instruct", dtype="float32", device="cpu")


def hf_greedy(model, ids: list[int], n: int) -> list[int]:
    """Plain argmax decoding with transformers' own cache; EOS is just another token (no masking)."""
    out, past, step_ids = [], None, torch.tensor([ids])
    with torch.inference_mode():
        for _ in range(n):
            result = model(step_ids, past_key_values=past, use_cache=True)
            past = result.past_key_values
            token = int(result.logits[0, -1].argmax())
            out.append(token)
            step_ids = torch.tensor([[token]])
    return out


def test_greedy_tokens_equal_transformers(llm, hf_model_and_tokenizer):
    model, tok = hf_model_and_tokenizer
    prompts = [tok.encode(p) for p in GOLDEN_PROMPTS]
    prompts += [tok.apply_chat_template(c, add_generation_prompt=True, tokenize=True) for c in GOLDEN_CHATS]
    prompts = [list(p["input_ids"]) if isinstance(p, dict) or hasattr(p, "input_ids") else list(p) for p in prompts]
    assert len(prompts) >= 12
    params = SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for ids, out in zip(prompts, outs):
        want = hf_greedy(model, ids, NUM_TOKENS)
        got = out.outputs[0].token_ids
        first = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), None)
        assert got == want, f"prompt {tok.decode(ids)!r}: first difference at output token {first}"


def test_chat_api_answers(llm):
    out = llm.chat([{"role": "user", "content": "Hi"}], SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)
    assert out[0].outputs[0].text.strip()
    assert out[0].outputs[0].finish_reason in ("stop", "length")
