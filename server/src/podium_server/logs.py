"""Podium's log lines on the server's stderr, in the server process and in the engine's own process.

uvicorn configures only its own loggers; without this the engine's startup stages (``startup
weights 0.81 s``), its KV-cache sizing and warnings about ignored settings would go nowhere. The
engine process is spawned, so it inherits nothing: it calls ``configure_logging`` itself.
"""

from __future__ import annotations

import logging
import sys

from .request_id import RequestIdLogFilter

LOGGERS = ("podium", "podium_server")
_FORMAT = "%(levelname)s:     %(name)s: %(message)s"  # aligned with uvicorn's "INFO:     ..." lines
_TRACE = 5  # uvicorn's level below debug


def configure_logging(level: str) -> None:
    """Send the podium loggers' records at ``level`` and above to stderr; idempotent."""
    numeric = _TRACE if level == "trace" else getattr(logging, level.upper())
    for name in LOGGERS:
        logger = logging.getLogger(name)
        logger.setLevel(numeric)
        if not any(getattr(h, "_podium", False) for h in logger.handlers):
            handler = logging.StreamHandler(sys.stderr)
            handler.setFormatter(logging.Formatter(_FORMAT))
            handler.addFilter(RequestIdLogFilter())  # "[request id] ..." on lines about one request
            handler._podium = True
            logger.addHandler(handler)
            logger.propagate = False  # a root handler set up elsewhere would print each line twice
