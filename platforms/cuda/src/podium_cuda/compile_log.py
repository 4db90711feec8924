"""Log every Triton kernel variant this process builds or loads (the ``compile_log`` platform option).

A variant compiled in the middle of serving stalls that step for the compile (a second or more on
a cold cache), so a benchmark's first run can be far slower than its second. With the option on, each in-memory cache miss of a Triton kernel (a compile, or a load from Triton's on-disk
cache) is logged with the seconds since the hook was installed and the variant's signature, so
variants missed by the startup warm-up can be found.
"""

from __future__ import annotations

import logging
import time

logger = logging.getLogger("podium_cuda.compile_log")
_installed: list[float] = []


def install() -> None:
    """Install the hook (once per process: the platform's activate calls it when the option is on)."""
    if _installed:
        return
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
