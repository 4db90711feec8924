"""The TPU plugin without a TPU: lazy import, availability reasons, backend selection, step shaping, graph runner.

These run in the main environment (no torch_xla) and in ``make test-tpu``'s environment alike;
torch_xla's runtime is faked where a test needs a particular device.
"""

from __future__ import annotations

import subprocess
import sys
import types

import numpy as np
import pytest
import torch

import podium_tpu.platform as tpu_platform
from podium_plugin_api import HostBatch
from podium_tpu import TpuPlatform
from podium_tpu.graph import XlaGraphRunner
from podium_tpu.pallas_attention import PallasAttentionBackend
from podium_tpu.selection import pallas_layout_supported, select_attention, tpu_generation
from podium_tpu.shaping import BucketShaping
from podium_tpu.xla_attention import XlaAttentionBackend


def test_importing_the_plugin_does_not_import_torch_xla():
    code = (
        "import sys, podium_tpu, podium_tpu.hooks, podium_tpu.platform, podium_tpu.pallas_attention, "
        "podium_tpu.xla_attention, podium_tpu.selection, podium_tpu.graph\n"
        "podium_tpu.TpuPlatform().capabilities()\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch_xla', 'jax')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[]"


def test_unavailable_with_install_hint_when_torch_xla_is_missing(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch_xla", None)  # import torch_xla -> ImportError
    availability = TpuPlatform().availability()
    assert not availability.ok
    assert "torch_xla is not installed" in availability.reason and "podium-tpu[tpu]" in availability.reason


def fake_runtime(monkeypatch, device_type):
    runtime = types.SimpleNamespace(device_type=lambda: device_type)
    monkeypatch.setattr(tpu_platform, "_xla_runtime", lambda: (types.SimpleNamespace(), runtime))


@pytest.mark.parametrize(
    ("device_type", "switch", "ok", "words"),
    [
        ("TPU", None, True, "TPU via torch_xla"),
        ("CPU", None, False, "'CPU'"),
        ("CPU", "1", True, "not a TPU"),
        ("CUDA", "1", False, "'CUDA'"),
        (None, None, False, "None"),
    ],
)
def test_availability_by_pjrt_device(monkeypatch, device_type, switch, ok, words):
    fake_runtime(monkeypatch, device_type)
    if switch is None:
        monkeypatch.delenv(tpu_platform.ALLOW_XLA_CPU_ENV, raising=False)
    else:
        monkeypatch.setenv(tpu_platform.ALLOW_XLA_CPU_ENV, switch)
    availability = TpuPlatform().availability()
    assert availability.ok is ok
    assert words in availability.reason


def test_a_broken_runtime_is_a_reason_not_a_crash(monkeypatch):
    def broken():
        raise OSError("libtpu.so: cannot open shared object file")

    monkeypatch.setattr(tpu_platform, "_xla_runtime", broken)
    availability = TpuPlatform().availability()
    assert not availability.ok and "OSError" in availability.reason


@pytest.mark.parametrize(
    ("kind", "generation"),
    [("TPU v2", 2), ("TPU v3", 3), ("TPU v4", 4), ("TPU v5 lite", 5), ("TPU v5p", 5), ("TPU v6 lite", 6),
     ("TPU7x", 7), ("cpu", None), ("CPU", None), ("", None), ("NVIDIA H100", None)],
)
def test_tpu_generation_from_device_kind(kind, generation):
    assert tpu_generation(kind) == generation


@pytest.mark.parametrize(
    ("kind", "jax", "kernel"),
    [("TPU v4", True, "pallas"), ("TPU v5 lite", True, "pallas"), ("TPU v6 lite", True, "pallas"),
     ("TPU7x", True, "pallas"), ("TPU v3", True, "xla"), ("TPU v2", True, "xla"), ("cpu", True, "xla"),
     ("TPU v5p", False, "xla")],
)
def test_pallas_selected_only_on_tpu_v4_and_newer_with_jax(kind, jax, kernel):
    choice = select_attention(kind, jax)
    assert choice.kernel == kernel and choice.reason


@pytest.mark.parametrize(
    ("kind", "backend"),
    [("TPU v5 lite", PallasAttentionBackend), ("TPU v3", XlaAttentionBackend), ("cpu", XlaAttentionBackend)],
)
def test_platform_builds_the_selected_backend_once(monkeypatch, kind, backend):
    monkeypatch.setattr(tpu_platform, "probe_device_kind", lambda: kind)
    monkeypatch.setattr(tpu_platform, "jax_available", lambda: True)
    platform = TpuPlatform()
    first = platform.attention_backend()
    assert type(first) is backend
    assert platform.attention_backend() is first  # the cache layout must not change under the core


@pytest.mark.parametrize(
    ("kv_heads", "head_size", "dtype", "ok"),
    [(8, 128, torch.bfloat16, True), (1, 128, torch.bfloat16, True), (4, 256, torch.float32, True),
     (16, 128, torch.float32, True), (3, 64, torch.bfloat16, False), (3, 128, torch.bfloat16, False),
     (8, 64, torch.bfloat16, False), (3, 128, torch.float32, False)],
)
def test_pallas_layout_support(kv_heads, head_size, dtype, ok):
    assert pallas_layout_supported(kv_heads, head_size, dtype) is ok


def test_capabilities_declare_xla_collectives_and_the_platform_shapes_its_steps():
    platform = TpuPlatform()
    caps = platform.capabilities()
    assert caps.distributed_backend == "xla" and caps.graph_capture and not caps.inference_mode
    assert caps.default_dtype in caps.dtypes
    assert isinstance(platform.step_shaping(), BucketShaping) and platform.step_shaping().sample_on_host


def host_batch(query_lens, seq_lens, rows):
    """A HostBatch the way the core builds one (slots: row r's blocks are 100 r, 100 r + 1, ...)."""
    cu = np.concatenate([[0], np.cumsum(query_lens)]).astype(np.int64)
    positions = np.concatenate([np.arange(s - q, s) for q, s in zip(query_lens, seq_lens)]).astype(np.int64)
    owners = np.repeat(np.asarray(rows), query_lens)
    slots = (owners * 100 + positions // 16) * 16 + positions % 16
    return HostBatch(np.arange(100, 100 + cu[-1]), positions, slots, cu, np.asarray(seq_lens, dtype=np.int64),
                     np.asarray(query_lens, dtype=np.int64), np.asarray(rows, dtype=np.int64))


@pytest.mark.parametrize(("query_lens", "seq_lens", "tokens", "seqs"),
                         [([1, 1, 1], [5, 9, 2], 16, 8), ([7, 1, 12, 1], [7, 40, 12, 3], 32, 8),
                          ([1] * 9, [4] * 9, 16, 16), ([30], [30], 32, 8)])
def test_bucket_shaping_pads_to_buckets_that_write_and_read_nothing(query_lens, seq_lens, tokens, seqs):
    syncs = []
    shaping = BucketShaping(lambda: syncs.append(1))
    batch = host_batch(query_lens, seq_lens, rows=list(range(len(query_lens))))
    padded = shaping.pad(batch)
    assert (padded.num_tokens, padded.num_seqs) == (tokens, seqs)
    n, s = batch.num_tokens, batch.num_seqs
    for name in ("token_ids", "positions", "slot_mapping", "seq_lens", "query_lens", "table_rows"):
        real = len(batch.token_ids) if name in ("token_ids", "positions", "slot_mapping") else s
        assert np.array_equal(getattr(padded, name)[:real], getattr(batch, name)), name  # the real ones first
    assert (padded.slot_mapping[n:] == -1).all()  # padding tokens write nowhere
    assert (padded.seq_lens[s:] == 0).all() and (padded.query_lens[s:] == 0).all()  # nor attend
    assert (padded.query_start_loc[s:] == n).all() and padded.query_start_loc.shape == (seqs + 1,)
    rows = shaping.logits_rows(np.array([0, 2]), padded)
    assert rows.tolist()[:2] == [0, 2] and len(rows) == seqs  # one logits shape per bucket
    shaping.end_forward()
    assert syncs == [1]  # the forward's graph is cut before the logits


def test_bucket_shaping_bounds_table_widths_and_graph_sizes():
    shaping = BucketShaping(lambda: None)
    assert [shaping.table_width(w, 24) for w in (1, 2, 3, 5, 9, 17, 24)] == [1, 2, 4, 8, 16, 24, 24]
    assert shaping.graph_batch_sizes([1, 2, 4, 8, 16, 24, 32, 48]) == [16, 32, 64]
    assert shaping.replay_extent(3, 2, 16, 24) == (16, 24)  # whole copies: one shape per captured size


def test_graph_runner_compiles_on_capture_and_syncs_every_replay():
    events = []
    runner = XlaGraphRunner(lambda: events.append("sync"))
    replay = runner.capture(lambda: events.append("trace") or len(events))
    assert events == ["trace", "sync"] and len(runner.compile_seconds) == 1
    assert replay() == 3
    assert events == ["trace", "sync", "trace", "sync"]
