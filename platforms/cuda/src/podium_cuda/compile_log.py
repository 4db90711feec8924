"""Log every Triton kernel variant this process builds or loads (``PODIUM_TRITON_COMPILE_LOG=1``).

A variant compiled in the middle of serving stalls that step for the compile (a second or more on
a cold cache), so a benchmark's first run can be far slower than its second. With the variable
set, each in-memory cache miss of a Triton kernel (a compile, or a load from Triton's on-disk
cache) is logged with the seconds since the hook was installed and the variant's signature, so
variants missed by the startup warm-up can be found.
"""

from __future__ import annotations

import logging
import os
import time

logger = logging.getLogger("podium_cuda.compile_log")
ENV = "PODIUM_TRITON_COMPILE_LOG"
_installed: list[float] = []


def install_from_env() -> bool:
    """Install the hook once when ``PODIUM_TRITON_COMPILE_LOG`` is set to 1; True if installed."""
    if os.environ.get(ENV) != "1" or _installed:
        return bool(_installed)
    from triton import knobs  # the runtime hook API of triton >= 3.4

    _installed.append(time.perf_counter())
    previous = knobs.runtime.jit_cache_hook

    def hook(*, key, repr, fn, compile, is_manual_warmup, already_compiled):
        logger.warning("triton variant at +%.1f s: %s", time.perf_counter() - _installed[0], repr)
        if previous is not None:
            return previous(key=key, repr=repr, fn=fn, compile=compile, is_manual_warmup=is_manual_warmup,
                            already_compiled=already_compiled)
        return False

    knobs.runtime.jit_cache_hook = hook
    return True
