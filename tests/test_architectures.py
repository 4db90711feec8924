"""The engine serves every newer architecture with transformers' greedy tokens (float32, CPU).

One tiny random model per architecture (``model_fixtures.ARCHITECTURES``), run through ``LLM`` with
a 4-token block, an 8-token step budget (prompts prefill in chunks, batched with other sequences'
decodes) and prefix caching: the second round repeats the first round's prompts' leading blocks,
so it starts from cached blocks. Every sequence's greedy tokens must equal transformers'
``generate``; every block is free again at the end. On a GPU (``cuda``) the same runs with graphs.
"""

from __future__ import annotations

import pytest
import torch
from model_fixtures import ARCHITECTURES, save_tiny_model

from podium import LLM, SamplingParams

NEW_ARCHITECTURES = ["mixtral-moe", "qwen2-moe-shared", "qwen3-moe-top8", "gemma2-softcap", "gemma3-local-global",
                     "phi3-longrope-partial", "qwen2-yarn"]
NEW_TOKENS = 6


def hf_greedy(hf_model, prompt: list[int]) -> list[int]:
    with torch.inference_mode():
        out = hf_model.generate(torch.tensor([prompt], device=hf_model.device), max_new_tokens=NEW_TOKENS, do_sample=False, min_new_tokens=NEW_TOKENS,
                                pad_token_id=0, eos_token_id=None)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
@pytest.mark.parametrize("name", NEW_ARCHITECTURES)
def test_greedy_tokens_equal_transformers_with_chunks_and_prefix_hits(name, device, tmp_path):
    model_type, overrides = ARCHITECTURES[name]
    hf_model = save_tiny_model(model_type, overrides, tmp_path, seed=11).to(device)
    gen = torch.Generator().manual_seed(3)
    shared = torch.randint(1, 96, (10,), generator=gen).tolist()
    first = [shared + torch.randint(1, 96, (n,), generator=gen).tolist() for n in (3, 7)] + [[5, 17, 2]]
    second = [shared + torch.randint(1, 96, (n,), generator=gen).tolist() for n in (1, 12)]
    llm = LLM(str(tmp_path), dtype="float32", device=device, block_size=4, max_num_batched_tokens=8, max_num_seqs=4,
              max_model_len=64, num_kv_blocks=96, enforce_eager=device == "cpu")
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    for prompts in (first, second):
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        for prompt, out in zip(prompts, outs):
            assert list(out.outputs[0].token_ids) == hf_greedy(hf_model, prompt), f"prompt of {len(prompt)} tokens"
    stats = llm.engine.stats()
    assert stats.prefix_cache_hits >= 2 * (len(shared) // 4)  # the second round's prompts reused shared blocks
    assert stats.num_free_blocks == stats.num_total_blocks
