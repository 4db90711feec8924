"""The server's settings: one validated object built at the edge (``podium serve``), then read-only."""

from __future__ import annotations

from dataclasses import dataclass, field

from podium.config import EngineConfig

from .audit import AuditSettings
from .tenants import parse_keys_file
from .tls import TLSSettings

LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")
ENGINE_MODES = ("process", "thread")  # where the model steps run: a child process or a thread (async_engine.py)


@dataclass(frozen=True)
class ServerSettings:
    engine: EngineConfig = field(default_factory=EngineConfig)
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None  # None or "": no authentication
    log_level: str = "info"
    max_request_bytes: int = 16 * 2**20  # larger bodies get 413
    shutdown_timeout: float = 30.0  # seconds in-flight requests get to finish after SIGTERM
    engine_mode: str = "process"
    api_keys_file: str | None = None  # keys -> tenants with limits (tenants.py); reloaded on change
    audit: AuditSettings | None = None  # --audit-log (audit.py)
    tls: TLSSettings | None = None  # --ssl-* (tls.py)

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if self.log_level not in LOG_LEVELS:
            raise ValueError(f"log_level must be one of {', '.join(LOG_LEVELS)}, got {self.log_level!r}")
        if self.max_request_bytes < 1024:
            raise ValueError(f"max_request_bytes must be >= 1024, got {self.max_request_bytes}")
        if self.engine_mode not in ENGINE_MODES:
            raise ValueError(f"engine_mode must be one of {', '.join(ENGINE_MODES)}, got {self.engine_mode!r}")
        if self.shutdown_timeout < 0:
            raise ValueError(f"shutdown_timeout must be >= 0, got {self.shutdown_timeout}")
        if self.api_keys_file is not None:
            parse_keys_file(self.api_keys_file)  # a broken file fails at startup, naming the problem

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{'https' if self.tls else 'http'}://{host}:{self.port}"
