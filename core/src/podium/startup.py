"""Where engine startup goes: wall-clock seconds per stage, in the order the engine runs them.

``LLMEngine.startup_seconds`` (and the ``podium.engine`` log line) hold one entry per stage:

    platform        choose the platform, load the plugins, platform defaults
    config          the model's config (GGUF metadata or config.json) and weight file list
    tokenizer       the tokenizer (for a GGUF file: from the tokenizer cache, or transformers' conversion
                    of its vocabulary on a cache miss; see ``podium.loader.tokenizer_cache``)
    custom_ops      the platform's fused ops (CPU: its native kernels, compiled on first use and cached)
    model_build     the model's modules, materialized uninitialized on the device
    weights         weights read, dequantized and copied in; the platform's model preparation
    kv_cache        KV cache sizing (a profiling pass where sized from free memory) and allocation, runner
    graph_capture   decode graphs captured (platforms that capture)
    total           the sum: the engine's constructor, load to ready

Imports (torch, transformers, the plugins) happen before the engine exists: ``benchmarks/startup.py``
measures them in fresh processes, with this breakdown.
"""

from __future__ import annotations

import logging
import time

logger = logging.getLogger("podium.engine")

STAGES = ("platform", "config", "tokenizer", "custom_ops", "model_build", "weights", "kv_cache", "graph_capture")


class StartupTimer:
    """Laps of a stopwatch, named by stage: ``lap("weights")`` ends the stage running since the last lap.

    Each lap is logged at info level as it ends (``startup weights  0.81 s  (...)``), so a slow start
    shows where it is while it happens; ``finish`` gives the table for the total line."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = dict.fromkeys(STAGES, 0.0)
        self._start = self._last = time.perf_counter()

    def lap(self, stage: str, inner: dict[str, float] | None = None, detail: str = "") -> None:
        """End ``stage``; ``inner`` stages timed inside it (by whoever ran them) are carved out of it.
        ``detail`` says what the stage chose or built, for the log."""
        now = time.perf_counter()
        carved = 0.0
        for name, seconds in (inner or {}).items():
            self._add(name, seconds)
            _log(name, seconds)
            carved += seconds
        seconds = max(0.0, now - self._last - carved)
        self._add(stage, seconds)
        _log(stage, seconds, detail)
        self._last = now

    def _add(self, stage: str, seconds: float) -> None:
        if stage not in self.seconds:
            raise ValueError(f"unknown startup stage {stage!r}; stages: {', '.join(STAGES)}")
        self.seconds[stage] += seconds

    def finish(self) -> dict[str, float]:
        """The stages and their ``total`` (the time since the timer started)."""
        return {**self.seconds, "total": time.perf_counter() - self._start}


def _log(stage: str, seconds: float, detail: str = "") -> None:
    logger.info("startup %-13s %6.2f s%s", stage, seconds, f"  ({detail})" if detail else "")


def format_startup(seconds: dict[str, float]) -> str:
    """``startup 3.21 s: platform 0.05, config 0.40, ...`` (stages that took no time left out)."""
    parts = ", ".join(f"{name} {value:.2f}" for name, value in seconds.items() if name != "total" and value >= 0.005)
    return f"startup {seconds['total']:.2f} s: {parts}"
