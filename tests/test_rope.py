"""Rope scaling against ``transformers.modeling_rope_utils``: inverse frequencies, attention factors,
the cos/sin cache row by row, and whole models decoding past the original context length.

``dynamic`` and ``longrope`` depend on the sequence length: Podium rotates position p with the
frequencies of a sequence ending at p, which is what transformers computes when it decodes one
token at a time with its cache; the model tests compare exactly that, past the point where the
frequencies change.
"""

from __future__ import annotations

import math

import pytest
import torch
from model_fixtures import FlatBatchRunner, load_podium, relative_error, save_tiny_model, tiny_config

from podium.models.rope_scaling import attention_factor, inverse_frequencies, rotary_angles, scaled_context_length
from podium.models.rotary import RotaryEmbedding
from podium_plugin_api.ops import rotary_embedding

SHORT = [1.0, 1.25, 1.5, 2.0, 2.5, 3.0, 4.0, 5.0]
LONG = [2.0, 3.0, 5.0, 8.0, 11.0, 15.0, 20.0, 27.0]

# name -> (model_type, config overrides, seq_lens to ask for)
CASES = {
    "linear": ("llama", {"rope_scaling": {"rope_type": "linear", "factor": 3.0}}, [None]),
    "llama3": ("llama", {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                          "high_freq_factor": 4.0, "original_max_position_embeddings": 64}}, [None]),
    "yarn": ("qwen2", {"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}}, [None]),
    "yarn-mscale-untruncated": ("llama", {"rope_scaling": {"rope_type": "yarn", "factor": 8.0, "mscale": 0.7,
                                                           "mscale_all_dim": 1.0, "beta_fast": 16, "beta_slow": 2,
                                                           "truncate": False, "original_max_position_embeddings": 64}},
                                [None]),
    "yarn-attention-factor": ("llama", {"rope_scaling": {"rope_type": "yarn", "factor": 2.0, "attention_factor": 1.3,
                                                         "original_max_position_embeddings": 128}}, [None]),
    "dynamic": ("llama", {"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, [None, 300, 1000]),
    "longrope-partial": ("phi3", {"pad_token_id": 0, "original_max_position_embeddings": 64, "partial_rotary_factor": 0.5,
                                  "rope_scaling": {"rope_type": "longrope", "short_factor": SHORT[:4],
                                                   "long_factor": LONG[:4]}}, [None, 64, 65]),
    "longrope": ("phi3", {"pad_token_id": 0, "original_max_position_embeddings": 32,
                          "rope_scaling": {"rope_type": "longrope", "short_factor": SHORT, "long_factor": LONG}},
                 [None, 33]),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_inverse_frequencies_and_attention_factor_match_transformers(name):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    model_type, overrides, seq_lens = CASES[name]
    config = tiny_config(model_type, **overrides)
    kind = config.rope_parameters["rope_type"]
    plain = inverse_frequencies(tiny_config(model_type, partial_rotary_factor=config.rope_parameters.get(
        "partial_rotary_factor", 1.0)))
    for seq_len in seq_lens:
        expected, factor = ROPE_INIT_FUNCTIONS[kind](config, "cpu", seq_len=seq_len)
        ours = inverse_frequencies(config, seq_len=seq_len)
        torch.testing.assert_close(ours, expected.float(), rtol=2e-6, atol=0)
        assert attention_factor(config) == pytest.approx(factor, rel=1e-12)
        if kind != "dynamic" or (seq_len or 0) > config.max_position_embeddings:
            assert not torch.allclose(ours, plain), f"{name} at {seq_len}: the scaling changed nothing"


@pytest.mark.parametrize("name", ["dynamic", "longrope-partial", "yarn"])
def test_cache_rows_are_transformers_cos_sin_of_a_token_decoded_at_that_position(name):
    """transformers' rotary module asked for position p alone, p rising (its decode): row p of ours."""
    from transformers import AutoModelForCausalLM

    model_type, overrides, _ = CASES[name]
    config = tiny_config(model_type, **{**overrides, "max_position_embeddings": 96})
    rotary_hf = AutoModelForCausalLM.from_config(config).model.rotary_emb
    ours = RotaryEmbedding(config, rotary_embedding)
    positions = list(range(0, ours.max_positions, 7))
    x = torch.zeros(1, 1, 4)
    for p in positions:
        cos, sin = rotary_hf(x, torch.tensor([[p]]))
        half = ours.rotary_dim // 2
        assert cos.shape[-1] == ours.rotary_dim
        torch.testing.assert_close(ours.cos_sin_cache[p, :half], cos[0, 0, :half], rtol=0, atol=2e-5)
        torch.testing.assert_close(ours.cos_sin_cache[p, half:], sin[0, 0, :half], rtol=0, atol=2e-5)


def test_dynamic_angles_grow_the_base_only_past_the_original_length():
    config = tiny_config("llama", max_position_embeddings=64, rope_scaling={"rope_type": "dynamic", "factor": 4.0})
    angles = rotary_angles(config, torch.arange(256))
    plain = torch.arange(256).float()[:, None] * inverse_frequencies(tiny_config("llama"))[None, :]
    assert torch.equal(angles[:64], plain[:64])
    assert not torch.allclose(angles[64:], plain[64:])
    assert scaled_context_length(config) == 256


def test_context_lengths_by_rope_type():
    assert scaled_context_length(tiny_config("llama", rope_scaling={"rope_type": "linear", "factor": 2.0})) == 512
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 100}
    assert scaled_context_length(tiny_config("qwen2", rope_scaling=yarn)) == 400
    longrope = CASES["longrope"][1]
    assert scaled_context_length(tiny_config("phi3", **longrope)) == 256  # max_position_embeddings already long


def test_partial_rotary_keeps_the_last_dimensions():
    model_type, overrides, _ = CASES["longrope-partial"]
    config = tiny_config(model_type, **overrides)
    emb = RotaryEmbedding(config, rotary_embedding)
    assert emb.rotary_dim == 8 and emb.cos_sin_cache.shape == (256, 8)  # head_dim 16 x 0.5
    bad = tiny_config("llama", partial_rotary_factor=0.1)
    with pytest.raises(ValueError, match="rotary dimension 1 .* must be even"):
        RotaryEmbedding(bad, rotary_embedding)


# name -> (model_type, overrides): decode past the original length, token by token
DECODE_CASES = {
    "phi3-longrope-partial": ("phi3", {"pad_token_id": 0, "original_max_position_embeddings": 12,
                                       "max_position_embeddings": 64, "partial_rotary_factor": 0.5,
                                       "rope_scaling": {"rope_type": "longrope", "short_factor": SHORT[:4],
                                                        "long_factor": LONG[:4]}}),
    "llama-dynamic": ("llama", {"max_position_embeddings": 12, "rope_scaling": {"rope_type": "dynamic", "factor": 3.0}}),
}


@pytest.mark.parametrize("name", sorted(DECODE_CASES))
def test_decode_past_the_original_length_matches_transformers_incremental_decode(name, tmp_path):
    model_type, overrides = DECODE_CASES[name]
    hf = save_tiny_model(model_type, overrides, tmp_path, seed=4)
    source, model = load_podium(tmp_path)
    tokens = [(7 * i + 3) % 90 for i in range(26)]
    prompt = 8
    runner = FlatBatchRunner(model, source.hf_config, block_size=4)
    ours = [runner.step({0: tokens[:prompt]})[0][-1]] + [runner.step({0: [t]})[0][-1] for t in tokens[prompt:-1]]
    theirs = []
    with torch.inference_mode():
        out = hf(torch.tensor([tokens[:prompt]]), use_cache=True)
        theirs.append(out.logits[0, -1])
        for t in tokens[prompt:-1]:
            out = hf(torch.tensor([[t]]), cache=out.past_key_values, use_cache=True)
            theirs.append(out.logits[0, -1])
    assert len(tokens) - 1 > 2 * 12  # well past the 12 positions where the frequencies change
    for step, (a, b) in enumerate(zip(ours, theirs)):
        assert relative_error(a, b.float()) <= 1e-4, f"decode step {step} (position {prompt + step - 1})"
    assert math.isfinite(float(ours[-1].sum()))
