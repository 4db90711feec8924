"""The pytest side of testing podium-cuda's kernels, shared by the CUDA and ROCm platforms' conftests.

Tests marked ``cuda`` need a GPU and are skipped where torch sees none, unless Triton's CPU
interpreter is requested (``TRITON_INTERPRET=1`` with triton installed): the kernels then run on
CPU tensors, except in bf16, which the interpreter computes wrongly (its bf16 ``tl.dot`` returns
garbage and its fp32 -> bf16 conversion truncates; seen with triton 3.6-3.9).
Imported by conftests only (it imports pytest); test support beside the CUDA tests (see ``cuda_checks``).
"""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch


def interpreting() -> bool:
    """Triton's CPU interpreter is requested, triton is importable and no GPU is there."""
    return (
        os.environ.get("TRITON_INTERPRET") == "1"
        and importlib.util.find_spec("triton") is not None
        and not torch.cuda.is_available()
    )


def kernel_device() -> str:
    """Where the kernels run: the GPU, or the CPU under the interpreter."""
    return "cpu" if interpreting() else "cuda"


def check_interpreter_numpy() -> None:
    """Triton 3.6's interpreter turns scalars loaded in a kernel into one-element arrays and converts
    them with ``int()`` (e.g. in ``range``), which numpy 2.4 made an error: every kernel with such a
    loop would fail with "only 0-dimensional arrays can be converted". Say so once instead."""
    import numpy

    if interpreting() and tuple(int(p) for p in numpy.__version__.split(".")[:2]) >= (2, 4):
        raise pytest.UsageError(f"TRITON_INTERPRET=1 needs numpy < 2.4 (found {numpy.__version__}): Triton's "
                                "interpreter converts one-element arrays to ints; pip install 'numpy<2.4'")


def skip_cuda_marked_without_gpu(items) -> None:
    """For ``pytest_collection_modifyitems``: skip ``cuda``-marked items with neither GPU nor interpreter
    (and stop with the reason where the interpreter cannot run them, ``check_interpreter_numpy``)."""
    if any(item.get_closest_marker("cuda") is not None for item in items):
        check_interpreter_numpy()
    if torch.cuda.is_available() or interpreting():
        return
    skip = pytest.mark.skip(reason="needs a GPU (torch.cuda.is_available() is False)")
    for item in items:
        if item.get_closest_marker("cuda") is not None:
            item.add_marker(skip)


def skip_interpreted_bf16(device: str, dtype: torch.dtype) -> None:
    """Skips a bf16 case when the kernels run under the interpreter."""
    if device == "cpu" and dtype == torch.bfloat16:
        pytest.skip("Triton's CPU interpreter computes bf16 tl.dot wrongly; runs on the GPU only")


def skip_interpreted_fp8_store(device: str) -> None:
    """Skips a bit-for-bit fp8 store check under the interpreter, whose fp8 casts round ties away
    from zero and saturate e4m3 at 256 (the GPU's cvt.rn.satfinite does what torch does)."""
    if device == "cpu":
        pytest.skip("Triton's CPU interpreter casts to fp8 unlike the GPU; bit checks run on the GPU only")


def require_gpu(device: str) -> str:
    """The device when it is a real GPU; skips under the interpreter."""
    if device != "cuda":
        pytest.skip("needs a real GPU, not Triton's interpreter")
    return device
