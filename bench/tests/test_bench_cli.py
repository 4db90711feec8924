"""``podium bench`` argument parsing: what the flags turn into."""

import math

import pytest

from podium.cli import build_parser, main
from podium_bench.cli import dataset_spec, engine_options, parse_percentiles, set_threads, throughput_backends


def parse(*argv):
    return build_parser().parse_args(["bench", *argv])


def test_throughput_flags():
    args = parse("throughput", "--model", "cfg/config.json", "--num-prompts", "4", "--input-len", "16",
                 "--output-len", "8", "--compare", "hf", "--json-out", "out.json", "--dtype", "bfloat16",
                 "--max-num-seqs", "8", "--max-num-batched-tokens", "512", "--enforce-eager", "--seed", "3",
                 "--hf-batch-size", "16", "--no-enable-prefix-caching")
    opts = engine_options(args)
    spec = dataset_spec(args, opts.config.seed)
    assert (spec.name, spec.num_prompts, spec.input_len, spec.output_len, spec.seed) == ("random", 4, 16, 8, 3)
    config = opts.config
    assert config.model == "cfg/config.json" and config.dtype == "bfloat16" and config.max_num_seqs == 8
    assert config.max_num_batched_tokens == 512 and config.enforce_eager and config.seed == 3
    assert config.enable_prefix_caching is False
    # only the flags given reach LLM(...): the rest keep the engine's (and the platform's) defaults
    assert opts.kwargs == {"model": "cfg/config.json", "dtype": "bfloat16", "max_num_seqs": 8,
                           "max_num_batched_tokens": 512, "enforce_eager": True, "seed": 3,
                           "enable_prefix_caching": False}
    assert engine_options(parse("throughput", "--kv-cache-dtype", "fp8")).kwargs == {"kv_cache_dtype": "fp8"}
    assert throughput_backends(args) == ["podium", "hf"] and args.hf_batch_size == 16 and args.json_out == "out.json"


def test_throughput_defaults_and_backends():
    args = parse("throughput")
    config = engine_options(args).config
    assert config.model == "smollm2-135m-instruct" and args.hf_batch_size == 64 and config.dtype == "auto"
    assert throughput_backends(args) == ["podium"] and args.threads is None
    assert parse("throughput", "--threads", "1").threads == 1
    with pytest.raises(ValueError, match="--threads"):
        set_threads(0)
    assert throughput_backends(parse("throughput", "--backend", "hf")) == ["hf"]
    with pytest.raises(ValueError, match="--compare"):
        throughput_backends(parse("throughput", "--backend", "hf", "--compare", "hf"))
    assert dataset_spec(parse("throughput", "--dataset-path", "p.jsonl"), 0).name == "file"
    spec = dataset_spec(parse("throughput", "--dataset", "prefix-repetition", "--prefix-len", "64",
                              "--suffix-len", "8", "--num-prefixes", "2"), 0)
    assert (spec.name, spec.prefix_len, spec.suffix_len, spec.num_prefixes) == ("prefix-repetition", 64, 8, 2)
    with pytest.raises(SystemExit):
        parse("throughput", "--dataset", "nope")


def test_latency_and_serve_flags():
    lat = parse("latency", "--batch-size", "4", "--input-len", "8", "--output-len", "16", "--num-iters", "5")
    assert (lat.batch_size, lat.input_len, lat.output_len, lat.num_iters, lat.num_iters_warmup) == (4, 8, 16, 5, 1)
    serve = parse("serve", "--base-url", "http://h:9/v1", "--endpoint", "chat", "--request-rate", "inf",
                  "--max-concurrency", "3", "--dataset", "sharegpt-like", "--ignore-eos", "--percentiles", "50,99")
    assert serve.request_rate == math.inf and serve.max_concurrency == 3 and serve.endpoint == "chat"
    assert serve.model is None and serve.ignore_eos and dataset_spec(serve).name == "sharegpt-like"
    assert parse_percentiles(serve.percentiles) == (50.0, 99.0)
    assert parse("serve", "--request-rate", "2.5").request_rate == 2.5
    with pytest.raises(ValueError, match="percentiles"):
        parse_percentiles("fifty")


def test_bench_without_kind_prints_help(capsys):
    assert main(["bench"]) == 2
    assert "throughput" in capsys.readouterr().out


def test_bad_dataset_values_are_one_line_errors(capsys):
    assert main(["bench", "serve", "--num-prompts", "0"]) == 1
    assert "--num-prompts must be >= 1" in capsys.readouterr().err
