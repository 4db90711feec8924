"""``Platform.prepare_model``: the engine hands it the loaded model once and runs what it returns."""

from __future__ import annotations

import pytest
import torch
from engine_fixtures import run_engines_on
from transformers import LlamaConfig

from podium import LLM, SamplingParams
from podium_plugin_api import Platform


class CountingModel(torch.nn.Module):
    """Wraps a model and counts its forward passes: proof the engine runs the returned module."""

    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.inner = inner
        self.forwards = 0

    def forward(self, *args):
        self.forwards += 1
        return self.inner(*args)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.inner.compute_logits(hidden)


class PreparingPlatform(Platform):
    name = "preparing"

    def __init__(self) -> None:
        self.seen: list[tuple[torch.nn.Module, bool]] = []  # (model, was it in eval mode)
        self.returned: CountingModel | None = None

    def prepare_model(self, model: torch.nn.Module) -> torch.nn.Module:
        self.seen.append((model, model.training))
        self.returned = CountingModel(model)
        return self.returned


@pytest.fixture
def tiny_config(tmp_path):
    LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=256, eos_token_id=2,
                bos_token_id=1).save_pretrained(tmp_path)
    return str(tmp_path / "config.json")


def test_engine_runs_the_model_prepare_model_returns(tiny_config, monkeypatch):
    platform = PreparingPlatform()
    run_engines_on(monkeypatch, platform)
    llm = LLM(tiny_config, dtype="float32", max_model_len=64)
    assert len(platform.seen) == 1
    model, training = platform.seen[0]
    assert not training  # handed over in eval mode, weights loaded
    assert llm.engine.model is platform.returned and llm.engine.runner.model is platform.returned
    llm.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True), use_tqdm=False)
    assert platform.returned.forwards >= 3


def test_default_prepare_model_returns_the_model_unchanged():
    model = torch.nn.Linear(2, 2)
    assert Platform().prepare_model(model) is model
