"""The router's HTTP/1.1 client for proxied requests: asyncio protocols and httptools' C parser.

The relay reads every chunk of every stream it passes on, so a chunk's cost on the one event loop
is what a burst of a decode step's chunks waits behind. Here a chunk costs one ``data_received``
(the C parser over the bytes of one TCP read) and one wake-up of the relay: no timeout scope per
read, no iterator layers. (httpx stays the client for everything else the router asks a replica.)

    Upstream.post(base_url, path, body, headers)
        ──► an idle keep-alive connection to the replica's host:port, else a new one
        ──► UpstreamResponse: status and headers, then next_chunk() until b"" (or read(): the whole body)
        ──► close(): back to the idle pool if the response ended cleanly, else the connection is closed

Invariants:

- A connection is reused only if its last response was parsed to its end and neither side asked
  to close it. Idle ones close after ``keepalive_s``, before a replica's server closes them (uvicorn
  waits 5 s), so a reused connection is never one the replica is closing; a reused one it closed
  anyway before answering a byte (the keep-alive race) is retried once on a new connection.
- Closing a response that has not ended closes its connection: the replica sees its client gone
  and aborts the request.
- ``next_chunk`` returns everything parsed and not yet taken, as one chunk: the body pieces of one
  TCP read (chunked encoding's chunks) joined, fewer sends for the relay. What is not taken yet is
  bounded: reading from the replica pauses while it exceeds ``max_buffered`` bytes.
- No timer per chunk: a read stamps the connection's time, and one timer per exchange fires at
  most once per ``read_timeout_s`` of quiet and rearms itself from the stamp.
"""

from __future__ import annotations

import asyncio
import re
import ssl
from dataclasses import dataclass
from urllib.parse import urlsplit

import certifi
import httptools

_MAX_IDLE_PER_HOST = 512
_INVALID_HEADER_VALUE = re.compile(r"[\r\n\0]")


class UpstreamError(Exception):
    """The exchange with a replica failed."""


class ConnectFailed(UpstreamError):
    """No connection: refused, unreachable, an unknown host, a failed TLS handshake."""


class ConnectTimeout(UpstreamError):
    """The replica's host did not accept the connection in time."""


class ConnectionLost(UpstreamError):
    """The connection closed, broke, or carried a malformed response before the response ended."""


class ReadTimeout(UpstreamError):
    """No byte from the replica for ``read_timeout_s``."""


class ResponseClosed(Exception):
    """The response was closed on this side (its client went away) while being read."""


class _Unanswered(ConnectionLost):
    """A reused connection closed before a byte of the response: the keep-alive race."""


@dataclass(frozen=True)
class Origin:
    """Where a replica's base URL sends requests: ``http://host:port/prefix``."""

    scheme: str
    host: str
    port: int
    host_header: str
    path_prefix: str

    @classmethod
    def parse(cls, base_url: str) -> Origin:
        split = urlsplit(base_url)
        if split.scheme not in ("http", "https") or not split.hostname:
            raise ValueError(f"not an http(s) base URL: {base_url!r}")
        port = split.port or (443 if split.scheme == "https" else 80)
        return cls(split.scheme, split.hostname, port, split.netloc.rpartition("@")[2], split.path.rstrip("/"))

    @property
    def key(self) -> tuple[str, str, int]:
        return self.scheme, self.host, self.port

    def request_head(self, path: str, content_length: int, headers: list[tuple[str, str]]) -> bytes:
        lines = [f"POST {self.path_prefix}{path} HTTP/1.1\r\nhost: {self.host_header}\r\n"
                 f"content-length: {content_length}\r\n"]
        for name, value in headers:
            if _INVALID_HEADER_VALUE.search(value):
                raise ValueError(f"header {name!r} has a line break or NUL in its value")
            lines.append(f"{name}: {value}\r\n")
        lines.append("\r\n")
        return "".join(lines).encode("latin-1")


class Upstream:
    """Keep-alive connections per replica ``host:port``; ``post`` sends one request on one of them."""

    def __init__(self, connect_timeout_s: float, read_timeout_s: float, keepalive_s: float = 2.0,
                 max_buffered: int = 256 * 1024) -> None:
        self.connect_timeout_s, self.read_timeout_s = connect_timeout_s, read_timeout_s
        self.keepalive_s, self.max_buffered = keepalive_s, max_buffered
        self._origins: dict[str, Origin] = {}
        self._idle: dict[tuple, list[_Connection]] = {}
        self._open: set[_Connection] = set()
        self._ssl: ssl.SSLContext | None = None

    async def post(self, base_url: str, path: str, body: bytes, headers: list[tuple[str, str]]) -> UpstreamResponse:
        """Send the request; return once the response's status and headers are in."""
        origin = self._origins.get(base_url)
        if origin is None:
            origin = self._origins[base_url] = Origin.parse(base_url)
        request = origin.request_head(path, len(body), headers) + body
        connection = self._take_idle(origin.key)
        if connection is not None:
            try:
                return await self._exchange(connection, request)
            except _Unanswered:
                pass  # the replica closed it as it was reused: once more on a new connection
        return await self._exchange(await self._connect(origin), request)

    @property
    def idle_connections(self) -> int:
        return sum(len(idle) for idle in self._idle.values())

    async def close(self) -> None:
        for connection in list(self._open):
            connection.close()
        self._idle.clear()

    async def _exchange(self, connection: _Connection, request: bytes) -> UpstreamResponse:
        response = UpstreamResponse(connection, self.read_timeout_s, self.max_buffered)
        try:
            connection.send(response, request)
            await response.head()
        except BaseException:
            response.close()
            raise
        return response

    async def _connect(self, origin: Origin) -> _Connection:
        loop = asyncio.get_running_loop()
        tls = self._ssl_context() if origin.scheme == "https" else None
        try:
            _, connection = await asyncio.wait_for(loop.create_connection(
                lambda: _Connection(self, origin.key), origin.host, origin.port, ssl=tls,
                server_hostname=origin.host if tls else None), self.connect_timeout_s)
        except asyncio.TimeoutError:
            raise ConnectTimeout(f"{origin.host}:{origin.port} accepted no connection within "
                                 f"{self.connect_timeout_s:g} s") from None
        except OSError as exc:
            raise ConnectFailed(f"cannot connect to {origin.host}:{origin.port}: {exc}") from exc
        return connection

    def _ssl_context(self) -> ssl.SSLContext:
        if self._ssl is None:  # the CA bundle httpx verifies with, so both clients trust the same replicas
            self._ssl = ssl.create_default_context(cafile=certifi.where())
        return self._ssl

    # -- the idle pool (called by the connections) ----------------------------------------------------
    def _take_idle(self, key: tuple) -> _Connection | None:
        idle = self._idle.get(key)
        while idle:
            connection = idle.pop()  # the most recently used
            if connection.take():
                return connection
        return None

    def park(self, connection: _Connection) -> bool:
        """Keep ``connection`` for reuse (False: enough idle ones already)."""
        idle = self._idle.setdefault(connection.key, [])
        if len(idle) >= _MAX_IDLE_PER_HOST:
            return False
        idle.append(connection)
        return True

    def opened(self, connection: _Connection) -> None:
        self._open.add(connection)

    def forget(self, connection: _Connection) -> None:
        """``connection`` closed: not open, not idle."""
        self._open.discard(connection)
        idle = self._idle.get(connection.key)
        if idle and connection in idle:
            idle.remove(connection)


class UpstreamResponse:
    """One exchange on a connection: the response's status, headers and body as they are parsed
    (httptools calls the ``on_*`` methods). ``close()`` it when done (idempotent)."""

    def __init__(self, connection: _Connection, read_timeout_s: float, max_buffered: int) -> None:
        self._connection: _Connection | None = connection
        self._loop = connection.loop
        self._parser = httptools.HttpResponseParser(self)
        self.status = 0
        self.headers: dict[str, str] = {}  # names lowercased; the last of a repeated name
        self._raw_headers: list[tuple[bytes, bytes]] = []
        self._body: list[bytes] = []
        self.buffered = 0  # body bytes parsed and not taken yet
        self._max_buffered = max_buffered
        self.paused = False  # reading from the connection, while ``buffered`` is over the bound
        self.complete = False  # the whole response is parsed
        self._until_eof = False  # a body with neither length nor chunks ends with the connection
        self.reusable = False  # complete, and neither side asked to close the connection
        self.heard = False  # a byte of the response arrived
        self._error: BaseException | None = None
        self._waiter: asyncio.Future | None = None
        self._read_timeout = read_timeout_s
        self._last_read = self._loop.time()
        self._read_timer: asyncio.TimerHandle | None = self._loop.call_at(self._last_read + read_timeout_s,
                                                                          self._check_read)

    async def head(self) -> None:
        """Wait for the status and headers."""
        while not self.status:
            if self._error is not None:
                raise self._error
            self._waiter = self._loop.create_future()
            await self._waiter

    async def next_chunk(self) -> bytes:
        """The body bytes parsed since the last call (waiting for some); b"" at the end. Raises an
        ``UpstreamError`` if the response broke off (once the bytes before the break are taken)."""
        while not self._body:
            if self.complete:
                return b""
            if self._error is not None:
                raise self._error
            self._waiter = self._loop.create_future()
            await self._waiter
        body = self._body
        chunk = body[0] if len(body) == 1 else b"".join(body)
        body.clear()
        self.buffered = 0
        if self.paused:
            self.paused = False
            self._connection.resume_reading()
        return chunk

    async def read(self) -> bytes:
        chunks = []
        while chunk := await self.next_chunk():
            chunks.append(chunk)
        return b"".join(chunks)

    def close(self) -> None:
        """Done with the response: its connection is kept for reuse if the response ended cleanly,
        else closed (the replica aborts what it was doing for it)."""
        if self._connection is None:
            return
        connection, self._connection = self._connection, None
        self._cancel_read_timer()
        self._body.clear()
        if not self.complete and self._error is None:
            self._error = ResponseClosed("the response was closed")
        self._wake()
        connection.release(self)

    # -- from the connection --------------------------------------------------------------------------
    def feed(self, data: bytes) -> None:
        self._last_read = self._loop.time()
        self.heard = True
        try:
            self._parser.feed_data(data)
        except (httptools.HttpParserError, httptools.HttpParserUpgrade) as exc:
            self.fail(ConnectionLost(f"the replica sent a malformed response ({exc})"))
            return
        if self.buffered > self._max_buffered and not self.paused and self._connection is not None:
            self.paused = True
            self._connection.pause_reading()
        self._wake()

    def lost(self, error: UpstreamError) -> None:
        """The connection closed under the response."""
        self._cancel_read_timer()
        if self.complete or self._error is not None:
            return
        if self._until_eof and self.status:
            self.complete = True
        else:
            self._error = error
        self._wake()

    def fail(self, error: UpstreamError) -> None:
        if not self.complete and self._error is None:
            self._error = error
        self._cancel_read_timer()
        if self._connection is not None:
            self._connection.close()
        self._wake()

    def _wake(self) -> None:
        waiter, self._waiter = self._waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _check_read(self) -> None:
        self._read_timer = None
        if self.complete or self._error is not None:
            return
        now = self._loop.time()
        due = (now if self.paused else self._last_read) + self._read_timeout  # paused: our reader is slow
        if due > now:
            self._read_timer = self._loop.call_at(due, self._check_read)
            return
        self.fail(ReadTimeout(f"no byte from the replica for {self._read_timeout:g} s"))

    def _cancel_read_timer(self) -> None:
        if self._read_timer is not None:
            self._read_timer.cancel()
            self._read_timer = None

    # -- httptools callbacks --------------------------------------------------------------------------
    def on_message_begin(self) -> None:
        if self.complete:  # a second response to one request: the connection is not to be trusted
            self.reusable = False

    def on_header(self, name: bytes, value: bytes) -> None:
        self._raw_headers.append((name, value))

    def on_headers_complete(self) -> None:
        status = self._parser.get_status_code()
        if status < 200 or self.status:  # an informational response: the real one follows
            self._raw_headers.clear()
            return
        self.headers = {n.decode("latin-1").lower(): v.decode("latin-1") for n, v in self._raw_headers}
        self._until_eof = ("content-length" not in self.headers and "chunked" not in
                           self.headers.get("transfer-encoding", "").lower() and status not in (204, 304))
        self.status = status

    def on_body(self, body: bytes) -> None:
        if not self.complete:
            self._body.append(body)
            self.buffered += len(body)

    def on_message_complete(self) -> None:
        if not self.status or self.complete:
            return  # the end of an informational response (or of a stray second one)
        self.complete = True
        self.reusable = self._parser.should_keep_alive() and not self._until_eof
        self._cancel_read_timer()


class _Connection(asyncio.Protocol):
    """One keep-alive connection to a replica; the exchange on it now gets what it reads."""

    def __init__(self, upstream: Upstream, key: tuple) -> None:
        self.key = key
        self.loop = asyncio.get_running_loop()
        self._upstream = upstream
        self._transport: asyncio.Transport | None = None
        self._response: UpstreamResponse | None = None
        self._idle_timer: asyncio.TimerHandle | None = None
        self._exchanges = 0

    def send(self, response: UpstreamResponse, request: bytes) -> None:
        self._exchanges += 1
        if self._transport is None or self._transport.is_closing():
            raise (_Unanswered if self._exchanges > 1 else ConnectionLost)("the connection closed before the request")
        self._response = response
        self._transport.write(request)

    def release(self, response: UpstreamResponse) -> None:
        """``response`` is closed: keep the connection for the next one if it may carry another."""
        if response is not self._response:
            return
        self._response = None
        transport = self._transport
        if response.reusable and transport is not None and not transport.is_closing() and self._upstream.park(self):
            if response.paused:  # (the body outgrew the bound before it ended)
                transport.resume_reading()
            self._idle_timer = self.loop.call_later(self._upstream.keepalive_s, self.close)
        else:
            self.close()

    def take(self) -> bool:
        """Taken from the idle pool: False if it closed meanwhile."""
        if self._idle_timer is not None:
            self._idle_timer.cancel()
            self._idle_timer = None
        return self._transport is not None and not self._transport.is_closing()

    def pause_reading(self) -> None:
        if self._transport is not None:
            self._transport.pause_reading()

    def resume_reading(self) -> None:
        if self._transport is not None:
            self._transport.resume_reading()

    def close(self) -> None:
        if self._idle_timer is not None:
            self._idle_timer.cancel()
            self._idle_timer = None
        self._upstream.forget(self)
        if self._transport is not None:
            self._transport.close()

    # -- asyncio.Protocol -----------------------------------------------------------------------------
    def connection_made(self, transport: asyncio.Transport) -> None:
        self._transport = transport
        self._upstream.opened(self)

    def data_received(self, data: bytes) -> None:
        response = self._response
        if response is None or response.complete:  # bytes nobody asked for: not a connection to keep
            if response is not None:
                response.reusable = False
            self.close()
            return
        response.feed(data)

    def connection_lost(self, exc: Exception | None) -> None:
        self._transport = None
        self.close()
        response = self._response
        if response is None:
            return
        if not response.heard and self._exchanges > 1:
            response.lost(_Unanswered("the replica closed a reused connection before answering"))
        else:
            reason = f" ({exc})" if exc else ""
            response.lost(ConnectionLost(f"the replica closed the connection before the response ended{reason}"))
