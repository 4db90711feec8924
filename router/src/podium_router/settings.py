"""The router's settings: one validated object built at the edge (``podium router``), then read-only.

A replica file lists replicas, one URL per line (``#`` starts a comment; an optional name after
the URL); a ``.toml`` or ``.json`` file holds ``replicas = [{url = ..., name = ...}, ...]`` instead. The router
rereads it when it changes: replicas it gained are added, replicas it lost are drained.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

from .policy import POLICIES

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")


@dataclass(frozen=True)
class ReplicaSpec:
    url: str
    name: str = ""

    def __post_init__(self) -> None:
        if not self.url.startswith(("http://", "https://")):
            raise ValueError(f"replica URL must start with http:// or https://, got {self.url!r}")


@dataclass(frozen=True)
class RouterSettings:
    replicas: tuple[ReplicaSpec, ...] = ()
    replica_file: Path | None = None
    host: str = "127.0.0.1"
    port: int = 8080
    api_key: str | None = None  # clients must send it (None: open)
    replica_api_key: str | None = None  # sent to the replicas
    policy: str = "ttft"
    default_prefill_rate: float = 2000.0  # tokens/s for a replica whose rate is not known yet
    decode_cap: int = 256  # requests in flight on a replica that reports no max_num_seqs
    approx_capacity_tokens: int = 1_000_000  # the approximate prefix record of a replica with no KV events
    poll_interval_s: float = 0.5  # replica reports and health checks
    unhealthy_after: int = 2  # consecutive failed checks
    max_attempts: int = 3  # replicas tried for a request that has not streamed a byte
    connect_timeout_s: float = 5.0
    request_timeout_s: float = 600.0  # no byte from the replica for this long: the attempt fails
    log_level: str = "info"

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {', '.join(POLICIES)}, got {self.policy!r}")
        for name in ("default_prefill_rate", "poll_interval_s", "connect_timeout_s", "request_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        for name in ("decode_cap", "approx_capacity_tokens", "unhealthy_after", "max_attempts"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.log_level not in LOG_LEVELS:
            raise ValueError(f"log_level must be one of {', '.join(LOG_LEVELS)}, got {self.log_level!r}")


@dataclass
class ReplicaFile:
    """Watches a replica file; ``changed()`` says whether to reread it."""

    path: Path
    _mtime: float | None = field(default=None, repr=False)

    def changed(self) -> bool:
        try:
            mtime = self.path.stat().st_mtime_ns
        except FileNotFoundError:
            return False
        if mtime == self._mtime:
            return False
        self._mtime = mtime
        return True

    def read(self) -> list[ReplicaSpec]:
        return read_replica_file(self.path)


def read_replica_file(path: Path) -> list[ReplicaSpec]:
    path = Path(path)
    text = path.read_text()
    if path.suffix == ".json":
        return _specs(json.loads(text), path)
    if path.suffix == ".toml":
        return _specs(tomllib.loads(text), path)
    specs = []
    for number, line in enumerate(text.splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        url, _, name = line.partition(" ")
        try:
            specs.append(ReplicaSpec(url, name.strip()))
        except ValueError as exc:
            raise ValueError(f"{path}:{number}: {exc}") from None
    return specs


def _specs(doc: dict, path: Path) -> list[ReplicaSpec]:
    entries = doc.get("replicas")
    if not isinstance(entries, list):
        raise ValueError(f"{path}: expected a list under 'replicas'")
    specs = []
    for i, entry in enumerate(entries):
        if isinstance(entry, str):
            entry = {"url": entry}
        if not isinstance(entry, dict) or "url" not in entry:
            raise ValueError(f"{path}: replicas[{i}] must be a URL or a table with 'url'")
        specs.append(ReplicaSpec(str(entry["url"]), str(entry.get("name", ""))))
    return specs
