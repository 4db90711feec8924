"""Request ids: the client's ``X-Request-Id`` when it is usable, else a new one.

The id follows the request everywhere: the response's ``X-Request-Id`` header, the server's log
lines about it (``RequestIdLogFilter``), the audit log, and the exemplars of the latency
histograms in ``/metrics`` (OpenMetrics). A router in front passes its own id down (it sends
``X-Request-Id`` to the replica), so one id names a request across the fleet.
"""

from __future__ import annotations

import logging
import re
import uuid
from contextvars import ContextVar

HEADER = b"x-request-id"
MAX_LENGTH = 100  # an OpenMetrics exemplar's labels may hold 128 characters in all
_USABLE = re.compile(rf"[A-Za-z0-9._:/+=@-]{{1,{MAX_LENGTH}}}")

# the id of the request the current task serves, for log lines (set by the service middleware)
current_request_id: ContextVar[str | None] = ContextVar("podium_request_id", default=None)


def new_request_id() -> str:
    return uuid.uuid4().hex


def request_id_from(headers: list[tuple[bytes, bytes]]) -> str:
    """The incoming ``X-Request-Id`` if it is short, printable and safe in logs; else a new id."""
    for name, value in headers:
        if name.lower() == HEADER:
            text = value.decode("latin-1").strip()
            if _USABLE.fullmatch(text):
                return text
            break
    return new_request_id()


class RequestIdLogFilter(logging.Filter):
    """Prefixes a record logged while serving a request with ``[request id]``."""

    def filter(self, record: logging.LogRecord) -> bool:
        request_id = current_request_id.get()
        if request_id is not None and not getattr(record, "_podium_request_id", False):
            record.msg = f"[{request_id}] {record.msg}"
            record._podium_request_id = True
        return True
