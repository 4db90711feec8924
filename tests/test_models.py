"""Podium's Llama-family models against transformers: every position's logits, float32, CPU.

Each architecture variant is a tiny random transformers model saved with save_pretrained; Podium
loads it through resolve_model + build_model + load_weights and runs ragged prompts in one flat
batch over a paged cache (block size 4, scrambled block ids), or in chunks continuing from the
cache. Every logit row must match transformers' own forward pass within relative error 1e-4.
"""

from __future__ import annotations

import pytest
import torch
from model_fixtures import (
    ARCHITECTURES,
    FlatBatchRunner,
    load_podium,
    reference_logits,
    relative_error,
    save_tiny_model,
    single_thread,  # noqa: F401  (module fixture, used below)
    tiny_config,
)

from podium.models.layers import layer_sliding_window
from podium.models.registry import build_model, init_random_weights, model_class
from podium.models.rotary import inverse_frequencies
from podium_cpu.attention import CpuAttentionBackend
from podium_plugin_api.ops import build_op_table

TOLERANCE = 1e-4
BLOCK_SIZE = 4
PROMPT_LENGTHS = [13, 7, 22, 1, 9]


pytestmark = pytest.mark.usefixtures("single_thread")


def prompts(vocab: int, lengths=PROMPT_LENGTHS, seed: int = 5) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=generator).tolist() for n in lengths]


@pytest.fixture(scope="module", params=sorted(ARCHITECTURES))
def tiny(request, tmp_path_factory):
    """(hf_model, podium_model, config) for one architecture variant."""
    model_type, overrides = ARCHITECTURES[request.param]
    folder = tmp_path_factory.mktemp(request.param)
    hf_model = save_tiny_model(model_type, overrides, folder, seed=len(request.param))
    source, podium_model = load_podium(folder)
    return hf_model, podium_model, source.hf_config


def test_one_flat_batch_matches_transformers(tiny):
    hf_model, model, config = tiny
    batch = prompts(config.vocab_size)
    runner = FlatBatchRunner(model, config, BLOCK_SIZE)
    logits = runner.step(dict(enumerate(batch)))
    for seq, tokens in enumerate(batch):
        expected = reference_logits(hf_model, tokens)
        assert logits[seq].shape == expected.shape and logits[seq].dtype == torch.float32
        assert relative_error(logits[seq], expected) <= TOLERANCE, f"sequence {seq} (length {len(tokens)})"


def test_chunks_then_decode_continue_from_the_cache(tiny):
    """Prefix chunk, then the rest minus one token, then a pure-decode step: the cache path."""
    hf_model, model, config = tiny
    batch = prompts(config.vocab_size, lengths=[13, 7, 22, 3], seed=9)
    runner = FlatBatchRunner(model, config, BLOCK_SIZE, backend=CpuAttentionBackend())
    first = [5, 2, 11, 1]
    got = {seq: [] for seq in range(len(batch))}
    steps = [
        {seq: tokens[: first[seq]] for seq, tokens in enumerate(batch)},
        {seq: tokens[first[seq] : -1] for seq, tokens in enumerate(batch) if len(tokens) - 1 > first[seq]},
        {seq: tokens[-1:] for seq, tokens in enumerate(batch)},
    ]
    for step in steps:
        for seq, rows in runner.step(step).items():
            got[seq].append(rows)
    for seq, tokens in enumerate(batch):
        assert relative_error(torch.cat(got[seq]), reference_logits(hf_model, tokens)) <= TOLERANCE


def test_sliding_window_is_shorter_than_the_prompts():
    """The sliding-window variants really slide (else the comparison above would not test it)."""
    _, mistral = ARCHITECTURES["mistral-sliding"]
    assert mistral["sliding_window"] < max(PROMPT_LENGTHS)
    config = tiny_config("qwen2", **ARCHITECTURES["qwen2-sliding-layers"][1])
    assert [layer_sliding_window(config, i) for i in range(3)] == [None, 6, 6]
    disabled = tiny_config("qwen2", use_sliding_window=False, sliding_window=6)
    assert [layer_sliding_window(disabled, i) for i in range(3)] == [None, None, None]


def test_llama3_inverse_frequencies_match_transformers():
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    model_type, overrides = ARCHITECTURES["llama3-rope-untied"]
    config = tiny_config(model_type, **overrides)
    expected, scaling = ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")
    ours = inverse_frequencies(config)
    assert scaling == 1.0
    assert torch.allclose(ours, expected, rtol=1e-6, atol=0)
    plain = inverse_frequencies(tiny_config("llama"))
    assert not torch.allclose(ours, plain), "llama3 scaling changed nothing: the test config is too weak"


def test_unknown_rope_type_is_an_error():
    config = tiny_config("llama")
    config.rope_parameters = {"rope_type": "mrope", "rope_theta": 10000.0}
    with pytest.raises(ValueError, match="rope_type 'mrope' is not supported; supported: default, linear"):
        build_model(config, build_op_table(), torch.float32, "cpu")


def test_missing_and_unexpected_weights_are_named(tiny):
    hf_model, _, config = tiny
    state = dict(hf_model.state_dict())
    fresh = build_model(config, build_op_table(), torch.float32, "cpu")
    dropped = next(name for name in state if name.startswith("model.layers.1.self_attn.") and "_proj" in name)
    weights = [(k, v) for k, v in state.items() if k != dropped] + [("model.layers.0.mlp.extra.weight", torch.ones(2))]
    with pytest.raises(ValueError) as error:
        fresh.load_weights(weights)
    assert dropped in str(error.value) and "model.layers.0.mlp.extra.weight" in str(error.value)
    assert "missing" in str(error.value) and "unexpected" in str(error.value)


def test_wrong_shape_is_named(tiny):
    hf_model, _, config = tiny
    fresh = build_model(config, build_op_table(), torch.float32, "cpu")
    with pytest.raises(ValueError, match=r"model\.norm\.weight.*\(3,\)"):
        fresh.load_weights([("model.norm.weight", torch.ones(3))])


def test_registry_lists_supported_architectures_and_takes_plugins():
    config = tiny_config("llama")
    config.architectures = ["GPTNeoXForCausalLM"]
    with pytest.raises(ValueError, match="LlamaForCausalLM.*Qwen3ForCausalLM"):
        model_class(config)

    class PluginModel(torch.nn.Module):
        def __init__(self, config, ops):
            super().__init__()
            self.proj = torch.nn.Linear(2, 2)

    assert model_class(config, {"GPTNeoXForCausalLM": PluginModel}) is PluginModel
    built = build_model(config, build_op_table(), torch.bfloat16, "cpu", {"GPTNeoXForCausalLM": PluginModel})
    assert built.proj.weight.dtype == torch.bfloat16 and built.proj.weight.device.type == "cpu"


def test_build_model_dtype_and_random_init_are_deterministic():
    config = tiny_config("qwen3", head_dim=32)
    first = build_model(config, build_op_table(), torch.bfloat16, "cpu")
    second = build_model(config, build_op_table(), torch.bfloat16, "cpu")
    init_random_weights(first, seed=3)
    init_random_weights(second, seed=3)
    for (name, a), (_, b) in zip(first.named_parameters(), second.named_parameters()):
        assert a.dtype == torch.bfloat16 and torch.equal(a, b), name
    params = dict(first.named_parameters())
    assert torch.all(params["model.layers.0.self_attn.q_norm.weight"] == 1)
    std = params["model.layers.0.mlp.gate_up_proj.weight"].float().std().item()
    assert 0.015 < std < 0.025
    cache = first.model.rotary_emb.cos_sin_cache
    assert cache.dtype == torch.float32 and cache.shape == (config.max_position_embeddings, 32)
    assert torch.allclose(cache[1, :16], torch.cos(inverse_frequencies(config)))
    init_random_weights(second, seed=4)
    assert not torch.equal(params["model.embed_tokens.weight"], dict(second.named_parameters())["model.embed_tokens.weight"])


def test_norms_and_silu_reach_the_projections_through_the_fusable_ops():
    """Each layer's two norms and its SiLU-mul go through rms_norm_linear / silu_and_mul_linear (API
    1.5), whose results the model uses: a platform's fused batch-1 GEMV replaces exactly these."""
    config = tiny_config("llama")
    calls = {"rms_norm_linear": 0, "silu_and_mul_linear": 0}
    reference = build_op_table()

    def counted(name, scale):
        def op(*args):
            calls[name] += 1
            out = reference[name](*args)
            return (out[0] * scale, out[1]) if isinstance(out, tuple) else out * scale
        return op

    logits = {}
    for scale in (1.0, 0.5):
        table = build_op_table({name: counted(name, scale) for name in calls})
        model = build_model(config, table, torch.float32, "cpu")
        init_random_weights(model, seed=1)
        logits[scale] = FlatBatchRunner(model, config, BLOCK_SIZE).step({0: [3, 1, 4], 1: [5]})
    layers = config.num_hidden_layers
    assert calls == {"rms_norm_linear": 2 * 2 * layers, "silu_and_mul_linear": 2 * layers}  # two forwards
    plain = build_model(config, build_op_table(), torch.float32, "cpu")
    init_random_weights(plain, seed=1)
    untouched = FlatBatchRunner(plain, config, BLOCK_SIZE).step({0: [3, 1, 4], 1: [5]})
    assert torch.equal(logits[1.0][0], untouched[0]) and torch.equal(logits[1.0][1], untouched[1])
    assert not torch.allclose(logits[0.5][1], untouched[1])  # the ops' outputs are what the layers use


def test_stacked_expert_checkpoints_load_like_per_expert_ones(tiny):
    """transformers 5 keeps experts stacked (``mlp.experts.gate_up_proj`` [E, 2I, H]); its state_dict,
    loaded as a checkpoint, gives the model save_pretrained's per-expert tensors gave."""
    hf_model, model, config = tiny
    state = hf_model.state_dict()
    if not any(name.endswith("experts.gate_up_proj") for name in state):
        pytest.skip("not a mixture-of-experts model")
    fresh = build_model(config, build_op_table(), torch.float32, "cpu")
    fresh.load_weights(state.items())
    for (name, ours), (_, theirs) in zip(model.named_parameters(), fresh.named_parameters()):
        assert torch.equal(ours, theirs), name
