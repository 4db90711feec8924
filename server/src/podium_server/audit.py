"""The audit log (``--audit-log FILE``): one JSON line per API request, rotated by size.

A line: ``time`` (UTC, when the request arrived), ``request_id``, ``tenant``, ``model``,
``endpoint``, ``prompt_tokens``, ``completion_tokens``, ``finish_reason`` (one per choice),
``status`` (the HTTP status; a stream's in-band error keeps its 200), ``latency_s``, ``client``;
with ``--audit-log-content`` also ``prompt`` (the request's prompt or messages) and ``output``
(the texts). Text is left out unless asked: audit logs are read by more people than prompts are
meant for.

Each line is written whole with one ``write`` on a file opened for appending, from the event loop
(one writer), so lines never interleave. When the file passes ``max_bytes`` it becomes
``FILE.1`` (``FILE.1`` becomes ``FILE.2`` ... up to ``backups``) and a new ``FILE`` starts.
"""

from __future__ import annotations

import json
import os
import threading
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from .errors import logger


@dataclass(frozen=True)
class AuditSettings:
    path: str
    content: bool = False
    max_bytes: int = 100 * 2**20
    backups: int = 5

    def __post_init__(self) -> None:
        if self.max_bytes < 1024:
            raise ValueError(f"audit_log_max_bytes must be >= 1024, got {self.max_bytes}")
        if self.backups < 0:
            raise ValueError(f"audit_log_backups must be >= 0, got {self.backups}")


@dataclass
class AuditRecord:
    arrival: float  # time.time() when the request arrived
    request_id: str
    tenant: str | None
    model: str
    endpoint: str
    client: str | None
    status: int
    latency_s: float
    prompt_tokens: int = 0
    completion_tokens: int = 0
    finish_reason: list[str] | None = None
    prompt: Any = None  # only with --audit-log-content
    output: list[str] | None = None

    def line(self, content: bool) -> str:
        entry = {"time": datetime.fromtimestamp(self.arrival, timezone.utc).isoformat(timespec="milliseconds"),
                 "request_id": self.request_id, "tenant": self.tenant, "model": self.model,
                 "endpoint": self.endpoint, "prompt_tokens": self.prompt_tokens,
                 "completion_tokens": self.completion_tokens, "finish_reason": self.finish_reason,
                 "status": self.status, "latency_s": round(self.latency_s, 6), "client": self.client}
        if content:
            entry["prompt"], entry["output"] = self.prompt, self.output
        return json.dumps(entry, ensure_ascii=False, default=str) + "\n"


class AuditLog:
    def __init__(self, settings: AuditSettings) -> None:
        self.settings = settings
        self._path = Path(settings.path)
        self._lock = threading.Lock()
        self._path.parent.mkdir(parents=True, exist_ok=True)
        self._fd = self._open()

    @property
    def content(self) -> bool:
        return self.settings.content

    def write(self, record: AuditRecord) -> None:
        data = record.line(self.settings.content).encode()
        with self._lock:
            try:
                if os.fstat(self._fd).st_size + len(data) > self.settings.max_bytes:
                    self._rotate()
                os.write(self._fd, data)
            except OSError as exc:  # a full disk must not fail the request that was already served
                logger.error("cannot write the audit log %s: %s", self._path, exc)

    def close(self) -> None:
        with self._lock:
            os.close(self._fd)

    def _open(self) -> int:
        return os.open(self._path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)

    def _rotate(self) -> None:
        os.close(self._fd)
        backups = self.settings.backups
        if backups == 0:
            self._path.unlink(missing_ok=True)
        else:
            for i in range(backups - 1, 0, -1):
                older = self._path.with_name(f"{self._path.name}.{i}")
                if older.exists():
                    older.replace(self._path.with_name(f"{self._path.name}.{i + 1}"))
            self._path.replace(self._path.with_name(f"{self._path.name}.1"))
        self._fd = self._open()
