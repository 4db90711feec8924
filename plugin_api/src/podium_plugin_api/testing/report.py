"""How the kit compares results and says what broke.

Every check raises ``ConformanceError`` with a message naming the capability under test, the
shapes involved, the largest error and where the first difference is, so a vendor can go
straight to the bug.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

# (atol, rtol) per dtype. float32 allows TF32 matmuls (10-bit mantissa), which GPU kernels use.
TOLERANCES: dict[torch.dtype, tuple[float, float]] = {
    torch.float64: (1e-7, 1e-7),
    torch.float32: (2e-3, 2e-3),
    torch.float16: (5e-3, 5e-3),
    torch.bfloat16: (3e-2, 3e-2),
}


class ConformanceError(AssertionError):
    """A platform does not do what the contract says; the message names the capability and how."""


def tolerance(dtype: torch.dtype) -> tuple[float, float]:
    """(atol, rtol) the kit allows when comparing results computed in ``dtype``."""
    if dtype in TOLERANCES:
        return TOLERANCES[dtype]
    eps = torch.finfo(dtype).eps if dtype.is_floating_point else 0.0
    return 16 * eps, 16 * eps


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def shape_of(t: Any) -> str:
    return str(list(t.shape)) if isinstance(t, torch.Tensor) else repr(type(t).__name__)


def guarded(what: str, fn: Callable[..., Any], *args: Any, context: str = "", **kwargs: Any) -> Any:
    """Call ``fn``; an exception becomes a ConformanceError naming ``what`` and ``context``."""
    try:
        return fn(*args, **kwargs)
    except ConformanceError:
        raise
    except Exception as exc:
        extra = f"\n{context}" if context else ""
        raise ConformanceError(f"{what} raised {type(exc).__name__}: {exc}{extra}") from exc


def _index(flat: int, shape: torch.Size) -> tuple[int, ...]:
    index = []
    for size in reversed(shape):
        index.append(flat % size)
        flat //= size
    return tuple(reversed(index))


def check_close(
    actual: torch.Tensor,
    expected: torch.Tensor,
    *,
    what: str,
    dtype: torch.dtype,
    locate: Callable[[tuple[int, ...]], str] | None = None,
    exact: bool = False,
) -> None:
    """Raise ConformanceError unless ``actual`` matches ``expected`` within ``dtype``'s tolerance."""
    if not isinstance(actual, torch.Tensor):
        raise ConformanceError(
            f"{what}: returned {type(actual).__name__}, expected a tensor of shape {list(expected.shape)}"
        )
    if tuple(actual.shape) != tuple(expected.shape):
        raise ConformanceError(f"{what}: returned shape {list(actual.shape)}, expected {list(expected.shape)}")
    got = actual.detach().to("cpu", torch.float64)
    want = expected.detach().to("cpu", torch.float64)
    atol, rtol = (0.0, 0.0) if exact else tolerance(dtype)
    err = (got - want).abs()
    both_inf = torch.isinf(got) & torch.isinf(want) & (torch.sign(got) == torch.sign(want))
    bad = ~((err <= atol + rtol * want.abs()) | both_inf)
    if not bool(bad.any()):
        return
    err = torch.where(both_inf, torch.zeros_like(err), err).nan_to_num(nan=float("inf"))
    worst = _index(int(err.flatten().argmax()), err.shape)
    first = _index(int(bad.flatten().nonzero()[0]), bad.shape)
    where = locate or (lambda idx: f"index {list(idx)}")
    rule = "exactly" if exact else f"within atol={atol:g}, rtol={rtol:g} for {dtype_name(dtype)}"
    raise ConformanceError(
        f"{what}: {int(bad.sum())} of {bad.numel()} values of the {list(got.shape)} result differ "
        f"(expected {rule}); max abs error {float(err[worst]):.4g} at {where(worst)}; "
        f"first difference at {where(first)}: got {float(got[first]):.6g}, expected {float(want[first]):.6g}"
    )
