"""Benchmark arithmetic from hand-computed timestamps (independent of numpy where it matters)."""

import math

import pytest

from podium_bench.metrics import (
    RequestTiming,
    ThroughputResult,
    distribution_ms,
    latency_summary,
    ratios,
    serve_metrics,
)


def _timings():
    return [
        # ttft 0.1, e2e 0.31, tpot (0.31 - 0.1) / 3 = 0.07, itl [0.05, 0.1, 0.05]
        RequestTiming(True, start=0.0, end=0.31, chunk_times=[0.1, 0.15, 0.25, 0.30], input_tokens=10, output_tokens=4),
        # ttft 0.2, e2e 0.4, tpot 0.2, itl [0.2]
        RequestTiming(True, start=1.0, end=1.4, chunk_times=[1.2, 1.4], input_tokens=20, output_tokens=2),
        # failed: counts nowhere
        RequestTiming(False, start=1.5, end=9.0, chunk_times=[1.6], input_tokens=999, output_tokens=50, error="boom"),
        # one token: ttft 0.5, e2e 0.6, no tpot, no itl
        RequestTiming(True, start=2.0, end=2.6, chunk_times=[2.5], input_tokens=5, output_tokens=1),
    ]


def test_per_request_definitions():
    a, b, _, d = _timings()
    assert a.ttft == pytest.approx(0.1)
    assert a.e2el == pytest.approx(0.31)
    assert a.tpot == pytest.approx(0.07)
    assert a.itls == pytest.approx([0.05, 0.1, 0.05])
    assert b.tpot == pytest.approx(0.2)
    assert d.tpot is None and d.itls == []
    assert RequestTiming(False, 0.0, 1.0).ttft is None


def test_serve_metrics_from_known_timestamps():
    m = serve_metrics(_timings(), duration_s=4.0)
    assert (m["completed"], m["failed"]) == (3, 1)
    assert m["total_input_tokens"] == 35 and m["total_output_tokens"] == 7
    assert m["request_throughput"] == pytest.approx(3 / 4)
    assert m["output_throughput"] == pytest.approx(7 / 4)
    assert m["total_token_throughput"] == pytest.approx(42 / 4)
    # ttft ms [100, 200, 500]: p99 interpolates at rank 0.99 * 2 = 1.98 -> 200 + 0.98 * 300
    assert m["mean_ttft_ms"] == pytest.approx(800 / 3)
    assert m["median_ttft_ms"] == pytest.approx(200)
    assert m["p99_ttft_ms"] == pytest.approx(494)
    # tpot ms [70, 200]
    assert m["mean_tpot_ms"] == pytest.approx(135)
    assert m["median_tpot_ms"] == pytest.approx(135)
    assert m["p99_tpot_ms"] == pytest.approx(70 + 0.99 * 130)
    # itl ms pooled [50, 100, 50, 200]
    assert m["mean_itl_ms"] == pytest.approx(100)
    assert m["median_itl_ms"] == pytest.approx(75)
    # e2e ms [310, 400, 600]
    assert m["mean_e2el_ms"] == pytest.approx(1310 / 3)
    assert m["median_e2el_ms"] == pytest.approx(400)


def test_serve_metrics_all_failed_and_bad_duration():
    m = serve_metrics([RequestTiming(False, 0.0, 1.0, error="x")], duration_s=1.0)
    assert m["completed"] == 0 and m["failed"] == 1 and m["mean_ttft_ms"] == 0.0 and m["output_throughput"] == 0
    with pytest.raises(ValueError, match="duration_s"):
        serve_metrics([], duration_s=0.0)


def test_distribution_percentiles():
    d = distribution_ms([0.001 * v for v in range(1, 101)], percentiles=(50, 90, 99))
    assert d["mean"] == pytest.approx(50.5)
    assert d["p50"] == pytest.approx(50.5)
    assert d["p90"] == pytest.approx(90.1)
    assert d["p99"] == pytest.approx(99.01)
    std = math.sqrt(sum((v - 50.5) ** 2 for v in range(1, 101)) / 100)
    assert d["std"] == pytest.approx(std)
    assert distribution_ms([], (99,)) == {"mean": 0.0, "median": 0.0, "std": 0.0, "p99": 0.0}


def test_throughput_result_and_ratio():
    fast = ThroughputResult("podium", elapsed_s=2.0, num_requests=4, input_tokens=100, output_tokens=60)
    slow = ThroughputResult("hf", elapsed_s=5.0, num_requests=4, input_tokens=100, output_tokens=60,
                            generated_tokens=80)
    assert fast.requests_per_s == 2.0 and fast.total_tokens_per_s == 80.0 and fast.output_tokens_per_s == 30.0
    r = ratios(fast, slow)
    assert r["output_tokens_per_s"] == pytest.approx(2.5) and r["requests_per_s"] == pytest.approx(2.5)
    assert slow.as_dict()["generated_tokens"] == 80 and "generated_tokens" not in fast.as_dict()
    with pytest.raises(ValueError, match="elapsed_s"):
        ThroughputResult("x", 0.0, 1, 1, 1)


def test_latency_summary():
    s = latency_summary([0.1, 0.3, 0.2], [1.1, 1.5, 1.3], output_len=11, batch_size=4)
    assert s["prefill_s_median"] == pytest.approx(0.2)
    assert s["decode_per_token_s"] == pytest.approx([0.1, 0.12, 0.11])
    assert s["decode_per_token_s_median"] == pytest.approx(0.11)
    assert s["decode_tokens_per_s"] == pytest.approx(4 / 0.11)
    with pytest.raises(ValueError, match="output-len"):
        latency_summary([0.1], [0.2], output_len=1, batch_size=1)
    with pytest.raises(ValueError):
        latency_summary([0.1], [], output_len=4, batch_size=1)
