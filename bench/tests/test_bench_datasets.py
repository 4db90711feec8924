"""Benchmark datasets: deterministic from the seed, lengths within their bounds, no special tokens."""

import json
import math

import numpy as np
import pytest

from podium_bench.datasets import DatasetSpec, TokenSpace, build_requests, summarize

SPECIALS = {0, 1, 2, 100}


class CharTokenizer:
    """A stand-in tokenizer: one token per character, ids 0-2 special."""

    all_special_ids = [0, 1, 2]
    added_tokens_decoder = {100: "<extra>"}

    def __len__(self):
        return 300

    def encode(self, text):
        return [3 + (ord(c) % 250) for c in text]

    def decode(self, ids):
        return "".join(chr(i) for i in ids)


def space(max_len=4096, tokenizer=None):
    return TokenSpace.build(300, max_len, tokenizer or CharTokenizer())


def test_token_space_excludes_specials():
    s = space()
    assert s.special_ids == frozenset(SPECIALS)
    allowed = set(s.allowed_ids().tolist())
    assert allowed == set(range(300)) - SPECIALS
    no_tok = TokenSpace.build(50, 64, None, special_ids=[2, None, 7])
    assert set(no_tok.allowed_ids().tolist()) == set(range(50)) - {2, 7}
    with pytest.raises(ValueError, match="vocab_size"):
        TokenSpace(1, 10)


@pytest.mark.parametrize("name", ["random", "sharegpt-like", "prefix-repetition"])
def test_same_seed_same_data_different_seed_different(name):
    spec = DatasetSpec(name, num_prompts=20, input_len=64, output_len=16, range_ratio=0.5, prefix_len=32,
                       suffix_len=16, num_prefixes=3, seed=7)
    a, b = build_requests(spec, space()), build_requests(spec, space())
    assert a == b
    other = build_requests(DatasetSpec(**{**vars(spec), "seed": 8}), space())
    assert [r.prompt_token_ids for r in other] != [r.prompt_token_ids for r in a]
    ids = np.concatenate([np.asarray(r.prompt_token_ids) for r in a])
    assert ids.min() >= 0 and ids.max() < 300 and not set(ids.tolist()) & SPECIALS


def test_random_lengths_within_range_ratio():
    spec = DatasetSpec("random", num_prompts=400, input_len=100, output_len=20, range_ratio=0.25, seed=1)
    reqs = build_requests(spec, space())
    ins, outs = [r.input_len for r in reqs], [r.output_len for r in reqs]
    assert min(ins) >= 75 and max(ins) <= 125 and min(outs) >= 15 and max(outs) <= 25
    assert len(set(ins)) > 20  # actually varies
    fixed = build_requests(DatasetSpec("random", num_prompts=5, input_len=33, output_len=7), space())
    assert {(r.input_len, r.output_len) for r in fixed} == {(33, 7)}


def test_random_rejects_what_does_not_fit():
    with pytest.raises(ValueError, match="--input-len"):
        build_requests(DatasetSpec("random", num_prompts=1, input_len=100, output_len=30), space(max_len=128))
    with pytest.raises(ValueError, match="range-ratio"):
        DatasetSpec("random", range_ratio=1.0)
    with pytest.raises(ValueError, match="num-prompts"):
        DatasetSpec("random", num_prompts=0)
    with pytest.raises(ValueError, match="dataset"):
        DatasetSpec("sharegpt")


def test_sharegpt_like_shape():
    reqs = build_requests(DatasetSpec("sharegpt-like", num_prompts=4000, seed=3), space(max_len=8192))
    stats = summarize(reqs)
    assert 170 <= stats["mean_input_len"] <= 230
    assert 150 <= stats["mean_output_len"] <= 210
    ins = np.array([r.input_len for r in reqs])
    assert ins.min() >= 4 and ins.max() <= 1024
    assert np.median(ins) < stats["mean_input_len"]  # right-skewed: a long tail
    assert ins.max() > 4 * stats["mean_input_len"]


def test_sharegpt_like_clipped_to_context():
    reqs = build_requests(DatasetSpec("sharegpt-like", num_prompts=500, seed=0), space(max_len=256))
    assert max(r.input_len for r in reqs) <= 128
    assert all(r.input_len + r.output_len <= 256 and r.output_len >= 1 for r in reqs)


def test_prefix_repetition_shares_prefixes():
    spec = DatasetSpec("prefix-repetition", num_prompts=12, output_len=5, prefix_len=40, suffix_len=10,
                       num_prefixes=3, seed=2)
    reqs = build_requests(spec, space())
    assert all(r.input_len == 50 and r.output_len == 5 for r in reqs)
    prefixes = {r.prompt_token_ids[:40] for r in reqs}
    assert len(prefixes) == 3
    for p in prefixes:
        assert sum(r.prompt_token_ids[:40] == p for r in reqs) == 4
    assert len({r.prompt_token_ids[40:] for r in reqs}) == 12
    # shuffled: the prefixes do not simply come round-robin in creation order
    first_seen = list(dict.fromkeys(r.prompt_token_ids[:40] for r in reqs))
    assert [first_seen.index(r.prompt_token_ids[:40]) for r in reqs] != [i % 3 for i in range(12)]
    with pytest.raises(ValueError, match="exceeds"):
        build_requests(DatasetSpec("prefix-repetition", prefix_len=200, suffix_len=50, output_len=10), space(max_len=256))


def test_file_dataset_jsonl_and_json(tmp_path):
    jsonl = tmp_path / "p.jsonl"
    jsonl.write_text("\n".join(json.dumps(r) for r in [
        {"prompt": "hello", "output_len": 4}, {"prompt": [5, 6, 7]}, {"prompt": "abc", "max_tokens": 2}]) + "\n")
    reqs = build_requests(DatasetSpec("file", num_prompts=10, output_len=9, path=str(jsonl)), space())
    assert [(r.input_len, r.output_len) for r in reqs] == [(5, 4), (3, 9), (3, 2)]
    assert reqs[0].prompt == "hello" and reqs[0].prompt_token_ids == tuple(CharTokenizer().encode("hello"))
    assert reqs[1].prompt is None
    as_json = tmp_path / "p.json"
    as_json.write_text(json.dumps([{"prompt": "x" * 10, "output_len": 3}] * 5))
    assert len(build_requests(DatasetSpec("file", num_prompts=2, path=str(as_json)), space())) == 2


def test_file_dataset_errors(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"prompt": ""}) + "\n")
    with pytest.raises(ValueError, match="record 0"):
        build_requests(DatasetSpec("file", path=str(bad)), space())
    text = tmp_path / "t.jsonl"
    text.write_text(json.dumps({"prompt": "hi"}) + "\n")
    with pytest.raises(ValueError, match="no tokenizer"):
        build_requests(DatasetSpec("file", path=str(text)), TokenSpace(300, 100))
    long = tmp_path / "long.jsonl"
    long.write_text(json.dumps({"prompt": "y" * 90, "output_len": 20}) + "\n")
    with pytest.raises(ValueError, match="exceeds the context"):
        build_requests(DatasetSpec("file", path=str(long)), space(max_len=100))
    with pytest.raises(ValueError, match="dataset-path"):
        DatasetSpec("file")
    with pytest.raises(ValueError, match="not a file"):
        build_requests(DatasetSpec("file", path=str(tmp_path / "missing.json")), space())


def test_summarize():
    reqs = build_requests(DatasetSpec("random", num_prompts=4, input_len=10, output_len=3), space())
    s = summarize(reqs)
    assert s["total_input_tokens"] == 40 and s["total_output_tokens"] == 12 and s["num_requests"] == 4
    assert math.isclose(s["mean_input_len"], 10.0)
