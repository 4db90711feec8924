"""The server's settings: one validated object built at the edge (``podium serve``), then read-only."""

from __future__ import annotations

from dataclasses import dataclass, field

from podium.config import EngineConfig

from .audit import AuditSettings
from .reasoning import REASONING_PARSERS
from .tenants import parse_keys_file
from .tls import TLSSettings
from .tool_parsers import TOOL_PARSERS

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
    tool_call_parser: str | None = None  # tool_parsers.TOOL_PARSERS
    enable_auto_tool_choice: bool = False  # tool_choice "auto": parse calls out of the text
    reasoning_parser: str | None = None  # reasoning.REASONING_PARSERS
    # CORS for browser front-ends: no origins, no CORS headers at all
    allowed_origins: tuple[str, ...] = ()
    allowed_methods: tuple[str, ...] = ("*",)
    allowed_headers: tuple[str, ...] = ("*",)
    # LoRA adapters loaded at startup: (name, folder) pairs (--lora-modules; needs engine.enable_lora)
    lora_modules: tuple[tuple[str, str], ...] = ()

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
        if self.tool_call_parser is not None and self.tool_call_parser not in TOOL_PARSERS:
            raise ValueError(f"tool_call_parser must be one of {', '.join(sorted(TOOL_PARSERS))}, "
                             f"got {self.tool_call_parser!r}")
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError("enable_auto_tool_choice needs a tool_call_parser (--tool-call-parser NAME)")
        if self.reasoning_parser is not None and self.reasoning_parser not in REASONING_PARSERS:
            raise ValueError(f"reasoning_parser must be one of {', '.join(sorted(REASONING_PARSERS))}, "
                             f"got {self.reasoning_parser!r}")

        names = [name for name, _ in self.lora_modules]
        if names and not self.engine.enable_lora:
            raise ValueError(f"--lora-modules ({', '.join(names)}) needs --enable-lora")
        if len(set(names)) != len(names):
            raise ValueError(f"--lora-modules names an adapter twice: {', '.join(names)}")

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{'https' if self.tls else 'http'}://{host}:{self.port}"
