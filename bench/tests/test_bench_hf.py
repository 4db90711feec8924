"""The transformers reference backend on a tiny random Llama (fast, no downloads)."""

import pytest
import torch
from transformers import LlamaConfig

from podium_bench.datasets import BenchRequest, DatasetSpec, TokenSpace, build_requests
from podium_bench.hf_backend import HFBackend, gguf_path, left_padded, load_hf_model


@pytest.fixture(scope="module")
def tiny_config(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny-llama")
    LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=256, eos_token_id=2, bos_token_id=1).save_pretrained(folder)
    return folder / "config.json"


@pytest.fixture(scope="module")
def backend(tiny_config):
    model = load_hf_model(str(tiny_config), torch.float32, torch.device("cpu"), seed=0)
    return HFBackend(model, torch.device("cpu"), batch_size=3, pad_token_id=0)


def test_random_model_from_config_json(tiny_config, backend):
    assert backend.model.config.vocab_size == 128 and backend.model.dtype == torch.float32
    assert backend.eos_token_id == 2
    again = load_hf_model(str(tiny_config.parent), torch.bfloat16, torch.device("cpu"), seed=0)
    assert again.dtype == torch.bfloat16
    same_seed = load_hf_model(str(tiny_config), torch.float32, torch.device("cpu"), seed=0)
    w = "model.layers.0.self_attn.q_proj.weight"
    assert torch.equal(backend.model.state_dict()[w], same_seed.state_dict()[w])


def test_left_padding():
    batch = [BenchRequest((5, 6, 7), 2), BenchRequest((9,), 4)]
    ids, mask = left_padded(batch, pad_id=0, device=torch.device("cpu"))
    assert ids.tolist() == [[5, 6, 7], [0, 0, 9]]
    assert mask.tolist() == [[1, 1, 1], [0, 0, 1]]


def test_generates_each_batch_to_its_longest_request(backend):
    reqs = [BenchRequest(tuple(range(3, 3 + n)), out) for n, out in [(5, 2), (9, 6), (3, 4), (7, 3), (4, 5)]]
    result = backend.run(reqs, progress=False)
    assert result.num_requests == 5 and result.output_tokens == 20 and result.input_tokens == 28
    assert result.generated_tokens == 3 * 6 + 2 * 5  # batches [2, 6, 4] and [3, 5]
    assert result.elapsed_s > 0 and result.backend == "hf"


def test_padding_does_not_change_greedy_tokens(backend):
    space = TokenSpace.build(128, 256, None, special_ids=[0, 1, 2])
    reqs = build_requests(DatasetSpec("random", num_prompts=3, input_len=12, output_len=6, range_ratio=0.5, seed=4),
                          space)
    together = backend.generate_tokens(reqs)  # [3, longest output]
    assert together.shape == (3, max(r.output_len for r in reqs))
    for row, req in enumerate(reqs):
        alone = backend.generate_tokens([BenchRequest(req.prompt_token_ids, together.shape[1])])
        assert alone[0].tolist() == together[row].tolist()


def test_eos_is_suppressed_until_the_end(tiny_config):
    model = load_hf_model(str(tiny_config), torch.float32, torch.device("cpu"), seed=0)
    head = torch.nn.Linear(32, 128, bias=True)
    with torch.no_grad():  # EOS (id 2) becomes the argmax everywhere: generation must still run to the end
        head.weight.copy_(model.lm_head.weight)
        head.bias.zero_()
        head.bias[2] = 1e4
    model.lm_head = head
    hf = HFBackend(model, torch.device("cpu"), batch_size=2, pad_token_id=0)
    tokens = hf.generate_tokens([BenchRequest((5, 6, 7), 5)])
    assert tokens.shape == (1, 5) and 2 not in tokens[0].tolist()


def test_gguf_path_and_bad_batch_size(backend):
    assert gguf_path("not-a-file.gguf") is None
    with pytest.raises(ValueError, match="hf-batch-size"):
        HFBackend(backend.model, torch.device("cpu"), batch_size=0)
