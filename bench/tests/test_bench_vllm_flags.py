"""``vllm bench``'s flags on ``podium bench``: the aliases, ``--burstiness``, ``--goodput``,
``--save-result``, and the tokenizer taken from the served model."""

import argparse
import asyncio
import json
import logging
import math

import httpx
import numpy as np
import pytest

from podium.cli import build_parser
from podium_bench import tokenizers
from podium_bench.cli import dataset_spec, serve_options
from podium_bench.metrics import RequestTiming, parse_goodput, serve_metrics
from podium_bench.report import result_path
from podium_bench.serve import arrival_delays, served_model


def parse(*argv):
    return build_parser().parse_args(["bench", *argv])


def test_vllm_spellings_parse_like_ours():
    vllm = parse("serve", "--dataset-name", "prefix_repetition", "--random-input-len", "16", "--random-output-len",
                 "8", "--random-range-ratio", "0.5", "--prefix-repetition-prefix-len", "32",
                 "--prefix-repetition-suffix-len", "4", "--prefix-repetition-num-prefixes", "3",
                 "--metric-percentiles", "50,99", "--save-result", "--result-filename", "r.json")
    ours = parse("serve", "--dataset", "prefix-repetition", "--input-len", "16", "--output-len", "8",
                 "--range-ratio", "0.5", "--prefix-len", "32", "--suffix-len", "4", "--num-prefixes", "3",
                 "--percentiles", "50,99", "--save-result", "--result-filename", "r.json")
    assert vars(vllm) == vars(ours)
    assert dataset_spec(vllm).name == "prefix-repetition" and serve_options(vllm).percentiles == (50.0, 99.0)
    assert dataset_spec(parse("throughput", "--dataset-name", "custom", "--dataset-path", "p.jsonl"), 0).name == "file"
    assert parse("throughput", "--output-json", "o.json").json_out == "o.json"


@pytest.mark.parametrize("name,message", [("sharegpt", "sharegpt-like"), ("sonnet", "unknown dataset 'sonnet'")])
def test_datasets_podium_lacks_are_refused_naming_the_alternative(name, message, capsys):
    with pytest.raises(SystemExit):
        parse("serve", "--dataset-name", name)
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("burstiness", [0.25, 1.0, 4.0])
def test_burstiness_keeps_the_rate_and_sets_the_spread(burstiness):
    """Gamma gaps of shape b and mean 1/rate: the coefficient of variation is 1/sqrt(b) (1: Poisson)."""
    gaps = np.asarray(arrival_delays(20000, rate=10.0, seed=3, burstiness=burstiness))
    assert gaps.mean() == pytest.approx(0.1, rel=0.05)
    assert gaps.std() / gaps.mean() == pytest.approx(1 / math.sqrt(burstiness), rel=0.06)
    assert arrival_delays(5, math.inf, 0, burstiness) == [0.0] * 5
    options = serve_options(parse("serve", "--burstiness", str(burstiness), "--request-rate", "4"))
    assert (options.burstiness, options.request_rate) == (burstiness, 4.0)
    with pytest.raises(ValueError, match="--burstiness must be > 0"):
        serve_options(parse("serve", "--burstiness", "0"))


def timing(ttft: float, gap: float, tokens: int) -> RequestTiming:
    chunks = [ttft + i * gap for i in range(tokens)]
    return RequestTiming(success=True, start=0.0, end=chunks[-1], chunk_times=chunks, input_tokens=4,
                         output_tokens=tokens)


def test_goodput_counts_the_requests_meeting_every_objective():
    # ttft / tpot / e2el in ms: (100, 50, 200), (300, 50, 400), (100, 150, 400), one token: (80, 0, 80)
    timings = [timing(0.1, 0.05, 3), timing(0.3, 0.05, 3), timing(0.1, 0.15, 3), timing(0.08, 0.0, 1),
               RequestTiming(success=False, start=0.0, end=0.01, error="HTTP 500")]
    duration = 2.0
    assert "request_goodput" not in serve_metrics(timings, duration)
    cases = {("ttft:150",): 3, ("ttft:150", "tpot:100"): 2, ("e2el:250",): 2, ("tpot:0",): 1, ("ttft:1000",): 4}
    for slos, good in cases.items():
        result = serve_metrics(timings, duration, goodput=parse_goodput(list(slos)))
        assert result["request_goodput"] == pytest.approx(good / duration), slos
    assert serve_options(parse("serve", "--goodput", "ttft:500", "tpot:50")).goodput == {"ttft": 500.0, "tpot": 50.0}
    for bad in (["itl:5"], ["ttft"], ["ttft:fast"], ["e2el:-1"]):
        with pytest.raises(ValueError, match="--goodput"):
            parse_goodput(bad)


def test_save_result_names_the_file_like_vllm(tmp_path):
    args = argparse.Namespace(save_result=False, result_filename=None, result_dir=None)
    assert result_path(args, "serve", "m") is None
    args.save_result = True
    auto = result_path(args, "serve", "/models/Llama-3.1-8B")
    assert auto.parent.name == "" and auto.name.startswith("serve-Llama-3.1-8B-") and auto.suffix == ".json"
    args.result_filename, args.result_dir = "run.json", str(tmp_path)
    assert result_path(args, "serve", "m") == tmp_path / "run.json"


def models_server(root):
    async def handler(request: httpx.Request) -> httpx.Response:
        assert request.url.path == "/v1/models"
        return httpx.Response(200, json={"object": "list", "data": [{"id": "served-name", "root": root}]})

    return httpx.MockTransport(handler)


def test_the_tokenizer_comes_from_the_served_model(tmp_path):
    """A server started on a local model (a tiny config here) lists it as its root: the datasets draw
    from that model's vocabulary, not the embedded SmolLM2's (whose ids a 96-token model refuses)."""
    from transformers import LlamaConfig

    LlamaConfig(vocab_size=96, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                max_position_embeddings=128, eos_token_id=2, bos_token_id=1).save_pretrained(tmp_path)
    options = serve_options(parse("serve", "--base-url", "http://fake:1"))
    root = str(tmp_path / "config.json")  # `podium serve path/config.json`: random weights of that shape
    resolved, names = asyncio.run(served_model(options, transport=models_server(root)))
    assert resolved.payload.model == "served-name" and names == [root, "served-name"]
    space = tokenizers.token_space_for_served(None, names)
    assert (space.vocab_size, space.max_model_len) == (96, 128)
    given = serve_options(parse("serve", "--model", "mine"))
    assert asyncio.run(served_model(given))[1] == ["mine"]  # nothing asked of the server


def test_an_unresolvable_served_model_falls_back_with_a_warning(monkeypatch, caplog):
    used = []
    real = tokenizers.token_space_for

    def recording(name, max_model_len=None):
        used.append(name)
        if name == tokenizers.DEFAULT_MODEL:
            return "embedded"
        return real(name, max_model_len)

    monkeypatch.setattr(tokenizers, "token_space_for", recording)
    with caplog.at_level(logging.WARNING, logger="podium_bench.tokenizers"):
        assert tokenizers.token_space_for_served(None, ["org/remote-model"]) == "embedded"
    assert used == ["org/remote-model", tokenizers.DEFAULT_MODEL]
    assert "pass --tokenizer" in caplog.text and "org/remote-model" in caplog.text
    used.clear()
    assert tokenizers.token_space_for_served(tokenizers.DEFAULT_MODEL, ["ignored"]) == "embedded"
    assert used == [tokenizers.DEFAULT_MODEL]


def test_result_json_is_written_where_save_result_says(tmp_path):
    from podium_bench.cli import _finish

    args = argparse.Namespace(json_out=str(tmp_path / "a.json"), save_result=True, result_filename="b.json",
                              result_dir=str(tmp_path))
    assert _finish({"command": "serve", "x": 1}, "table", args, "m") == 0
    assert json.loads((tmp_path / "a.json").read_text()) == json.loads((tmp_path / "b.json").read_text())
