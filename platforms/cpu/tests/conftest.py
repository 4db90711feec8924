"""Fixtures shared by the CPU platform's tests."""

from __future__ import annotations

import pytest

from podium_cpu.native_kernels import load_kernels


@pytest.fixture(scope="session")
def kernels():
    """The native kernels this CPU builds and runs; tests that need them skip where they don't."""
    loaded, why = load_kernels()
    if loaded is None:
        pytest.skip(f"native kernels unavailable: {why}")
    return loaded
