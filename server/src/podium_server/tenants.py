"""API keys and tenants: who is calling, and whether their limits let this request in.

``--api-keys-file FILE`` (TOML, or JSON of the same shape) maps keys, stored as their SHA-256
(``printf %s "$KEY" | sha256sum``), to tenants with limits and a scheduling weight::

    [tenants.team-a]
    requests_per_minute = 600       # sliding 60 s window
    tokens_per_minute = 200000      # prompt + completion tokens of finished requests, 60 s window
    max_concurrent_requests = 16
    max_tokens = 1024               # the largest max_tokens a request may ask (unset: clamped to it)
    weight = 2.0                    # fair share in the scheduler (podium.fair_share)

    [[keys]]
    sha256 = "<64 hex digits>"
    tenant = "team-a"

Every limit is optional (absent: none). The file is read again when it changes (checked at most
once a ``reload_interval``); a file that no longer parses keeps the previous keys and logs why.
Usage counters live per tenant name, so a reload keeps them. ``--api-key`` stays: that key is the
tenant ``default``, without limits.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import math
import os
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python < 3.11
    import tomli as tomllib

from .errors import logger

DEFAULT_TENANT = "default"
WINDOW_S = 60.0
_LIMIT_FIELDS = {"requests_per_minute": int, "tokens_per_minute": int, "max_concurrent_requests": int,
                 "max_tokens": int, "weight": float}


@dataclass(frozen=True)
class TenantPolicy:
    name: str
    requests_per_minute: int | None = None
    tokens_per_minute: int | None = None
    max_concurrent_requests: int | None = None
    max_tokens: int | None = None
    weight: float = 1.0


@dataclass
class Rejection:
    """Why a request may not go in: the 429's message, the metric's reason, and when to retry."""

    reason: str  # requests_per_minute, tokens_per_minute, max_concurrent_requests
    message: str
    retry_after_s: int


@dataclass
class _Usage:
    requests: deque[float] = field(default_factory=deque)  # admission times in the window
    tokens: deque[tuple[float, int]] = field(default_factory=deque)  # (finish time, tokens)
    token_sum: int = 0
    in_flight: int = 0


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def parse_keys_file(path: str | Path) -> dict[str, TenantPolicy]:
    """{sha256 of a key: its tenant's policy}; raises ValueError naming the problem."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise ValueError(f"cannot read the API keys file {path}: {exc}") from None
    try:
        data = json.loads(text) if path.suffix == ".json" else tomllib.loads(text)
    except ValueError as exc:
        raise ValueError(f"the API keys file {path} does not parse: {exc}") from None
    if not isinstance(data, dict) or set(data) - {"tenants", "keys"}:
        raise ValueError(f"{path}: expected a table with 'tenants' and 'keys' only")
    tenants = {name: _policy(path, name, fields) for name, fields in (data.get("tenants") or {}).items()}
    keys: dict[str, TenantPolicy] = {}
    for i, entry in enumerate(data.get("keys") or []):
        where = f"{path}: keys[{i}]"
        if not isinstance(entry, dict) or set(entry) != {"sha256", "tenant"}:
            raise ValueError(f"{where} must have exactly 'sha256' and 'tenant'")
        digest, tenant = str(entry["sha256"]).lower(), entry["tenant"]
        if len(digest) != 64 or any(c not in "0123456789abcdef" for c in digest):
            raise ValueError(f"{where}.sha256 must be 64 hex digits (printf %s KEY | sha256sum)")
        if not isinstance(tenant, str) or not tenant:
            raise ValueError(f"{where}.tenant must be a non-empty name")
        keys[digest] = tenants.get(tenant) or TenantPolicy(tenant)
    if not keys:
        raise ValueError(f"{path} holds no keys")
    return keys


def _policy(path: Path, name: str, fields: dict) -> TenantPolicy:
    if not isinstance(fields, dict):
        raise ValueError(f"{path}: tenants.{name} must be a table")
    values = {}
    for key, value in fields.items():
        kind = _LIMIT_FIELDS.get(key)
        if kind is None:
            raise ValueError(f"{path}: tenants.{name}.{key} is not a known limit ({', '.join(_LIMIT_FIELDS)})")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0 \
                or (kind is int and value != int(value)):
            raise ValueError(f"{path}: tenants.{name}.{key} must be a positive {kind.__name__}, got {value!r}")
        values[key] = kind(value)
    return TenantPolicy(name, **values)


class TenantRegistry:
    """Resolves ``Authorization`` headers to tenants and enforces their limits (event loop only)."""

    def __init__(self, keys_file: str | None, api_key: str | None, reload_interval: float = 1.0,
                 clock=time.monotonic) -> None:
        self._file = keys_file
        self._single = f"Bearer {api_key}".encode() if api_key else None
        self._reload_interval = reload_interval
        self._clock = clock
        self._keys: dict[str, TenantPolicy] = parse_keys_file(keys_file) if keys_file else {}
        self._stamp = self._file_stamp()
        self._checked = clock()
        self._usage: dict[str, _Usage] = {}

    @property
    def enabled(self) -> bool:
        return bool(self._file or self._single)

    def authenticate(self, authorization: bytes) -> TenantPolicy | None:
        """The tenant of this ``Authorization`` header, or None for a missing or unknown key."""
        self._maybe_reload()
        if self._single is not None and hmac.compare_digest(authorization, self._single):
            return TenantPolicy(DEFAULT_TENANT)
        scheme, _, key = authorization.decode("latin-1").partition(" ")
        if scheme.lower() != "bearer" or not key:
            return None
        return self._keys.get(hash_key(key.strip()))  # a digest lookup: the key's bytes leak no timing

    def admit(self, tenant: TenantPolicy) -> Rejection | None:
        """Count a new request against the tenant's limits, or say why it may not go in."""
        now, usage = self._clock(), self._usage.setdefault(tenant.name, _Usage())
        _expire(usage, now)
        if tenant.max_concurrent_requests is not None and usage.in_flight >= tenant.max_concurrent_requests:
            return Rejection("max_concurrent_requests", f"tenant {tenant.name!r} already has "
                             f"{usage.in_flight} requests in flight (limit {tenant.max_concurrent_requests})", 1)
        if tenant.requests_per_minute is not None and len(usage.requests) >= tenant.requests_per_minute:
            wait = usage.requests[0] + WINDOW_S - now
            return Rejection("requests_per_minute", f"tenant {tenant.name!r} reached its limit of "
                             f"{tenant.requests_per_minute} requests per minute", _seconds(wait))
        if tenant.tokens_per_minute is not None and usage.token_sum >= tenant.tokens_per_minute:
            wait = _tokens_wait(usage, tenant.tokens_per_minute, now)
            return Rejection("tokens_per_minute", f"tenant {tenant.name!r} used {usage.token_sum} tokens in the "
                             f"last minute (limit {tenant.tokens_per_minute})", _seconds(wait))
        usage.requests.append(now)
        usage.in_flight += 1
        return None

    def done(self, tenant: TenantPolicy, tokens: int) -> None:
        """An admitted request ended, having used ``tokens`` (prompt + completion)."""
        usage = self._usage.setdefault(tenant.name, _Usage())
        usage.in_flight = max(0, usage.in_flight - 1)
        if tokens > 0:
            usage.tokens.append((self._clock(), tokens))
            usage.token_sum += tokens

    # -- the keys file ---------------------------------------------------------------------------
    def _file_stamp(self) -> tuple[int, int] | None:
        try:
            st = os.stat(self._file) if self._file else None
        except OSError:
            return None
        return (st.st_mtime_ns, st.st_size) if st else None

    def _maybe_reload(self) -> None:
        now = self._clock()
        if not self._file or now - self._checked < self._reload_interval:
            return
        self._checked = now
        stamp = self._file_stamp()
        if stamp == self._stamp:
            return
        self._stamp = stamp
        try:
            self._keys = parse_keys_file(self._file)
        except ValueError as exc:
            logger.error("keeping the previous API keys: %s", exc)
            return
        logger.info("reloaded the API keys file %s: %d keys", self._file, len(self._keys))


def _expire(usage: _Usage, now: float) -> None:
    while usage.requests and usage.requests[0] <= now - WINDOW_S:
        usage.requests.popleft()
    while usage.tokens and usage.tokens[0][0] <= now - WINDOW_S:
        usage.token_sum -= usage.tokens.popleft()[1]


def _tokens_wait(usage: _Usage, limit: int, now: float) -> float:
    """Seconds until enough tokens leave the window to go under ``limit``."""
    left = usage.token_sum
    for when, tokens in usage.tokens:
        left -= tokens
        if left < limit:
            return when + WINDOW_S - now
    return WINDOW_S


def _seconds(wait: float) -> int:
    return max(1, math.ceil(wait))
