"""Conformance test kit for platform plugins.

Run it against an installed platform from any folder::

    pytest --podium-platform NAME

The pytest side lives in ``pytest_plugin`` (registered through pytest's ``pytest11`` entry
point, inactive without the option) and ``suite`` (the tests). The checks are plain functions
that raise ``ConformanceError``, usable without pytest:

- ``lookup``            find and activate the platform through the contract's discovery
- ``platform_checks``   API version, capabilities, device, memory, distributed backend name
- ``kv_cache_checks``   allocation, cache layout, writes by slot mapping
- ``attention_checks``  attention against the reference on ragged batches; graph replay vs eager
- ``op_checks``         custom ops against ``podium_plugin_api.ops.REFERENCE_OPS``
- ``generation``        greedy generation of a tiny model over the paged cache vs a CPU reference
"""

from importlib import import_module
from typing import Any

_EXPORTS = {"FoundPlatform": ".lookup", "KitSetupError": ".lookup", "find_platform": ".lookup",
            "ConformanceError": ".report", "check_close": ".report", "tolerance": ".report"}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:  # lazy, so pytest's entry point does not import torch
    if name in _EXPORTS:
        return getattr(import_module(_EXPORTS[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
