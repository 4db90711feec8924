"""The server's settings: one validated object built at the edge (``podium serve``), then read-only."""

from __future__ import annotations

from dataclasses import dataclass, field

from podium.config import EngineConfig

from .audit import AuditSettings
from .tenants import parse_keys_file
from .tls import TLSSettings

LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")
METRICS_COMPAT = ("none", "vllm")  # extra metric names served besides podium:'s (metrics.py)
ENGINE_MODES = ("process", "thread")  # where the model steps run: a child process or a thread (async_engine.py)


@dataclass(frozen=True)
class ServerSettings:
    engine: EngineConfig = field(default_factory=EngineConfig)
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None  # None or "": no authentication
    log_level: str = "info"
    max_request_bytes: int = 16 * 2**20  # larger bodies get 413
    max_json_depth: int = 64  # deeper JSON nesting gets 400 (json_limits.py)
    max_json_string_chars: int = 8 * 2**20  # a longer JSON string gets 400
    max_json_array_items: int = 2**20  # a longer JSON array (or object) gets 400
    metrics_compat: str = "none"  # "vllm": /metrics also serves vLLM's names for the same series
    shutdown_timeout: float = 30.0  # seconds in-flight requests get to finish after SIGTERM (drain.py)
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
        for name in ("max_json_depth", "max_json_string_chars", "max_json_array_items"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.metrics_compat not in METRICS_COMPAT:
            raise ValueError(f"metrics_compat must be one of {', '.join(METRICS_COMPAT)}, got {self.metrics_compat!r}")
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
