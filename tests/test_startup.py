"""The engine's startup breakdown: every stage reported, time landing in the stage that spent it."""

from __future__ import annotations

import logging
import time

import pytest

from podium import LLM
from podium import shard as shard_module
from podium.loader import embedded_gguf_path, gguf_source
from podium.loader import tokenizer_cache as cache
from podium.startup import STAGES, StartupTimer, format_startup

DELAY = 0.3


def test_laps_accumulate_and_inner_stages_are_carved_out(monkeypatch):
    clock = iter([10.0, 11.0, 13.5, 14.0, 20.0])
    monkeypatch.setattr(time, "perf_counter", lambda: next(clock))
    timer = StartupTimer()  # starts at 10.0
    timer.lap("platform")  # 11.0
    timer.lap("config", inner={"tokenizer": 0.75})  # 13.5: 2.5 s, of which 0.75 s were the tokenizer
    timer.lap("weights")  # 14.0
    seconds = timer.finish()  # 20.0
    assert seconds == {**dict.fromkeys(STAGES, 0.0), "platform": 1.0, "config": 1.75, "tokenizer": 0.75,
                       "weights": 0.5, "total": 10.0}
    assert format_startup(seconds) == "startup 10.00 s: platform 1.00, config 1.75, tokenizer 0.75, weights 0.50"


def test_unknown_stage_is_an_error():
    with pytest.raises(ValueError, match="unknown startup stage 'warmup'"):
        StartupTimer().lap("warmup")


def test_engine_reports_each_stage_where_its_time_went(monkeypatch, caplog):
    """A delay injected into the tokenizer load and one into the model build show up in exactly those stages."""
    real_tokenizer = gguf_source.gguf_tokenizer
    real_build = shard_module.build_model

    def slow_tokenizer(path, cache=None):
        time.sleep(DELAY)
        return real_tokenizer(path, cache)

    def slow_build(*args, **kwargs):
        time.sleep(2 * DELAY)
        return real_build(*args, **kwargs)

    monkeypatch.setattr(gguf_source, "gguf_tokenizer", slow_tokenizer)
    monkeypatch.setattr(shard_module, "build_model", slow_build)  # ModelShard builds the model
    with caplog.at_level(logging.INFO, logger="podium.engine"):
        llm = LLM("smollm2-135m-instruct", device="cpu", max_model_len=256)
    seconds = llm.engine.startup_seconds
    assert set(seconds) == {*STAGES, "total"}
    assert all(value >= 0 for value in seconds.values())
    # every second lands in exactly one stage: a stage counted twice (or an inner one not carved out) breaks this
    assert sum(seconds[s] for s in STAGES) == pytest.approx(seconds["total"], abs=0.01)
    assert DELAY <= seconds["tokenizer"] < seconds["total"]
    assert 2 * DELAY <= seconds["model_build"] < seconds["total"]
    assert seconds["weights"] > 0
    assert any(r.getMessage().startswith(f"startup {seconds['total']:.2f} s: ") and "tokenizer" in r.getMessage()
               for r in caplog.records)


def test_tokenizer_stage_times_a_tokenizer_cache_hit(tokenizer_cache, monkeypatch):
    """With the tokenizer cache filled, loading from it (not converting) is the tokenizer stage."""
    gguf_source.gguf_tokenizer(embedded_gguf_path())  # fills the cache
    real_load = cache._load

    def slow_load(*args):
        time.sleep(DELAY)
        return real_load(*args)

    monkeypatch.setattr(cache, "_load", slow_load)
    monkeypatch.setattr(gguf_source, "convert_gguf_tokenizer", lambda path: pytest.fail("converted on a cache hit"))
    llm = LLM("smollm2-135m-instruct", device="cpu", max_model_len=256)
    seconds = llm.engine.startup_seconds
    assert sum(seconds[s] for s in STAGES) == pytest.approx(seconds["total"], abs=0.01)
    assert DELAY <= seconds["tokenizer"] < seconds["total"]
