"""A vLLM user's offline script (examples/vllm_offline.py: ``from podium import LLM, SamplingParams``
with vLLM's engine arguments) runs unchanged; each prompt form gives the same greedy text."""

from __future__ import annotations

import logging
import pathlib
import runpy

import pytest

SCRIPT = pathlib.Path(__file__).parents[1] / "examples" / "vllm_offline.py"


@pytest.mark.slow
def test_the_vllm_style_script_runs(caplog, capsys):
    with caplog.at_level(logging.WARNING):
        result = runpy.run_path(str(SCRIPT), run_name="vllm_offline")["main"]()
    texts = result["generate"]
    assert len(texts) == 3 and len(set(texts)) == 1 and texts[0].strip()  # the same prompt three ways
    assert result["chat"].strip() and result["conversations"] == 2
    ignored = [r.getMessage().split("=", 1)[0] for r in caplog.records if r.name == "podium.engine_args"]
    assert sorted(ignored) == ["disable_log_stats", "max_seq_len_to_capture", "swap_space"]  # each said once
    assert any(r.getMessage().startswith("gpu_memory_utilization=0.9 is ignored") for r in caplog.records)
    assert "generate: 'The capital of France is'" in capsys.readouterr().out
