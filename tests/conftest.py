"""Cross-package tests: ``cuda``-marked tests are skipped where torch sees no CUDA device.

No test writes the user's tokenizer cache (``~/.cache/podium/tokenizers``): the session turns it
off, for the servers and processes tests start as well; the ``tokenizer_cache`` fixture turns it
on in a temporary ``XDG_CACHE_HOME`` for the tests about it.
"""

from __future__ import annotations

import os

import pytest
import torch

from podium.loader import tokenizer_cache as cache


def pytest_configure(config):
    os.environ[cache.CACHE_ENV] = "0"


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (torch.cuda.is_available() is False)")
    for item in items:  # the marker, not the keyword: every item under platforms/cuda/ has the keyword "cuda"
        if item.get_closest_marker("cuda") is not None:
            item.add_marker(skip)


@pytest.fixture
def tokenizer_cache(tmp_path, monkeypatch):
    """The tokenizer cache turned on under a temporary XDG_CACHE_HOME; its (not yet created) root folder."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg-cache"))
    monkeypatch.setenv(cache.CACHE_ENV, "1")
    return cache.cache_root()
