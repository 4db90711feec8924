"""Intel Extension for PyTorch (IPEX), optional: imported lazily, used only when it loads cleanly.

IPEX is built against one torch release exactly (2.8 for IPEX 2.8); a mismatched or broken install
is reported, never fatal: the platform then runs its own kernels.
"""

from __future__ import annotations

import importlib
from types import ModuleType

_STATUS: dict[str, tuple[ModuleType | None, str]] = {}


def ipex_status() -> tuple[ModuleType | None, str]:
    """(the ``intel_extension_for_pytorch`` module, "") or (None, why not); imported once per process."""
    if "ipex" not in _STATUS:
        _STATUS["ipex"] = _import_ipex()
    return _STATUS["ipex"]


def _import_ipex() -> tuple[ModuleType | None, str]:
    if importlib.util.find_spec("intel_extension_for_pytorch") is None:
        return None, ""
    try:
        ipex = importlib.import_module("intel_extension_for_pytorch")
    except Exception as exc:  # a broken IPEX install must not take the CPU platform down
        return None, f"intel_extension_for_pytorch is installed but failed to import ({type(exc).__name__}: {exc})"
    return ipex, ""
