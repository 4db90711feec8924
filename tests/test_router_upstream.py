"""The router's upstream HTTP/1.1 client (podium_router.upstream) against raw asyncio servers that
write exactly the bytes each test wants, split where it wants: bodies must come out as the server
meant them (chunked or by length, split at every byte), connections must be reused only after a
clean response, and the read timeout, the buffering bound and closing must hold."""

from __future__ import annotations

import asyncio
import time

import pytest

from podium_router.upstream import ConnectFailed, ConnectionLost, ReadTimeout, ResponseClosed, Upstream

pytestmark = pytest.mark.timeout(60)

EVENTS = [b'data: {"choices": [{"text": "t%d"}]}\n\n' % i for i in range(5)] + [b"data: [DONE]\n\n"]
BODY = b"".join(EVENTS)


def chunked(pieces: list[bytes]) -> bytes:
    return b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in pieces) + b"0\r\n\r\n"


def head(status: int = 200, **headers: str) -> bytes:
    lines = [f"HTTP/1.1 {status} X"] + [f"{k.replace('_', '-')}: {v}" for k, v in headers.items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


class RawServer:
    """A TCP server on 127.0.0.1 that answers each request of each connection with ``answer(n, writer)``
    (n counts requests across connections); it records how many connections it accepted."""

    def __init__(self, answer) -> None:
        self.answer, self.connections, self.requests, self.closed = answer, 0, 0, 0

    async def __aenter__(self) -> RawServer:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"
        return self

    async def __aexit__(self, *exc) -> None:
        self.server.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = int(next(line.split(b":")[1] for line in head.split(b"\r\n")
                                  if line.lower().startswith(b"content-length")))
                await reader.readexactly(length)
                self.requests += 1
                if await self.answer(self.requests, writer) is False:
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            self.closed += 1
            writer.close()


async def _post(upstream: Upstream, server: RawServer) -> tuple[int, list[bytes]]:
    response = await upstream.post(server.url, "/v1/completions", b'{"prompt": "hi"}', [("x-request-id", "r1")])
    chunks = []
    try:
        while chunk := await response.next_chunk():
            chunks.append(chunk)
    finally:
        response.close()
    return response.status, chunks


@pytest.mark.parametrize("wire", [head(transfer_encoding="chunked") + chunked(EVENTS),
                                  head(content_length=str(len(BODY))) + BODY], ids=["chunked", "length"])
def test_bodies_split_at_every_byte_come_out_whole_on_one_reused_connection(wire: bytes):
    async def answer(n: int, writer: asyncio.StreamWriter) -> None:
        split = n - 1  # request n splits the response after byte n - 1
        writer.write(wire[:split])
        await writer.drain()
        await asyncio.sleep(0.002)  # (a read of its own, as a slow network would make it)
        writer.write(wire[split:])
        await writer.drain()

    async def scenario() -> RawServer:
        upstream = Upstream(connect_timeout_s=5, read_timeout_s=5)
        async with RawServer(answer) as server:
            for _ in range(len(wire) + 1):
                status, chunks = await _post(upstream, server)
                assert status == 200 and b"".join(chunks) == BODY, server.requests
        await upstream.close()
        return server

    server = asyncio.run(scenario())
    assert server.connections == 1  # every response ended cleanly: one connection for all


def test_what_arrives_in_one_read_is_one_chunk():
    async def answer(n: int, writer: asyncio.StreamWriter) -> None:
        writer.write(head(transfer_encoding="chunked") + chunked(EVENTS[:1]).removesuffix(b"0\r\n\r\n"))
        await writer.drain()
        await asyncio.sleep(0.05)
        writer.write(chunked(EVENTS[1:]))  # five chunks of the chunked encoding in one write

    async def scenario() -> list[bytes]:
        upstream = Upstream(connect_timeout_s=5, read_timeout_s=5)
        async with RawServer(answer) as server:
            _, chunks = await _post(upstream, server)
        await upstream.close()
        return chunks

    assert asyncio.run(scenario()) == [EVENTS[0], b"".join(EVENTS[1:])]


def test_a_connection_is_not_reused_after_a_response_that_did_not_end_cleanly():
    async def answer(n: int, writer: asyncio.StreamWriter) -> bool | None:
        if n == 2:  # a response cut short: the client reads past what came, the server closes
            writer.write(head(transfer_encoding="chunked") + chunked(EVENTS)[:40])
            return False
        if n == 4:  # a response whose reader closes it half-way
            writer.write(head(transfer_encoding="chunked") + chunked(EVENTS[:2]).removesuffix(b"0\r\n\r\n"))
            await writer.drain()
            return None
        if n == 6:  # the server says it closes (and leaves that to the client)
            writer.write(head(content_length=str(len(BODY)), connection="close") + BODY)
            return None
        writer.write(head(content_length=str(len(BODY))) + BODY)
        return None

    async def scenario() -> list[int]:
        upstream = Upstream(connect_timeout_s=5, read_timeout_s=5)
        connections = []
        async with RawServer(answer) as server:
            assert (await _post(upstream, server))[0] == 200
            with pytest.raises(ConnectionLost):
                await _post(upstream, server)
            connections.append(server.connections)
            assert b"".join((await _post(upstream, server))[1]) == BODY
            response = await upstream.post(server.url, "/", b"", [])
            assert await response.next_chunk() == EVENTS[0] + EVENTS[1]
            response.close()
            with pytest.raises(ResponseClosed):
                await response.next_chunk()
            await asyncio.sleep(0.05)
            connections.append(server.connections)
            assert b"".join((await _post(upstream, server))[1]) == BODY
            connections.append(server.connections)
            assert b"".join((await _post(upstream, server))[1]) == BODY  # (connection: close)
            assert b"".join((await _post(upstream, server))[1]) == BODY
            await asyncio.sleep(0.05)
            connections += [server.connections, server.closed]
        await upstream.close()
        return connections

    # 1 ok, 2 cut (its connection closed), 3 on a new one, 4 closed by its reader (the server sees
    # its connection close), 5 on a new one, 6 "connection: close", 7 on a new one (still open)
    assert asyncio.run(scenario()) == [1, 2, 3, 4, 3]


def test_idle_connections_expire_and_a_reused_one_closed_before_answering_is_retried():
    async def answer(n: int, writer: asyncio.StreamWriter) -> bool | None:
        if n == 3:
            return False  # the keep-alive race: the replica closes the reused connection, unanswered
        writer.write(head(content_length=str(len(BODY))) + BODY)
        return None

    async def scenario() -> list[int]:
        upstream = Upstream(connect_timeout_s=5, read_timeout_s=5, keepalive_s=0.2)
        seen = []
        async with RawServer(answer) as server:
            await _post(upstream, server)
            assert upstream.idle_connections == 1
            await asyncio.sleep(0.4)
            assert upstream.idle_connections == 0 and server.closed == 1  # expired, closed on our side
            await _post(upstream, server)
            seen.append(server.connections)
            assert b"".join((await _post(upstream, server))[1]) == BODY  # request 3 unanswered, 4 answers
            seen += [server.connections, server.requests]
        await upstream.close()
        return seen

    assert asyncio.run(scenario()) == [2, 3, 4]


def test_a_new_connection_closed_before_answering_is_an_error_not_a_retry():
    async def answer(n: int, writer: asyncio.StreamWriter) -> bool:
        return False

    async def scenario() -> int:
        upstream = Upstream(connect_timeout_s=5, read_timeout_s=5)
        async with RawServer(answer) as server:
            with pytest.raises(ConnectionLost):
                await _post(upstream, server)
        await upstream.close()
        return server.requests

    assert asyncio.run(scenario()) == 1


def test_the_read_timeout_counts_quiet_time_only():
    async def answer(n: int, writer: asyncio.StreamWriter) -> None:
        writer.write(head(transfer_encoding="chunked"))
        for event in EVENTS[:4]:  # a chunk every 0.1 s: never 0.25 s quiet
            writer.write(chunked([event]).removesuffix(b"0\r\n\r\n"))
            await writer.drain()
            await asyncio.sleep(0.1)
        await asyncio.sleep(10)  # then silence

    async def scenario() -> tuple[list[bytes], float]:
        upstream = Upstream(connect_timeout_s=5, read_timeout_s=0.25)
        chunks = []
        async with RawServer(answer) as server:
            response = await upstream.post(server.url, "/", b"", [])
            with pytest.raises(ReadTimeout):
                while True:
                    chunks.append(await response.next_chunk())
                    last = time.monotonic()
            quiet = time.monotonic() - last
            response.close()
        await upstream.close()
        return chunks, quiet

    chunks, quiet = asyncio.run(scenario())
    assert b"".join(chunks) == b"".join(EVENTS[:4])
    assert 0.2 < quiet < 2.0


def test_a_slow_reader_bounds_what_is_buffered_and_still_gets_every_byte():
    body = bytes(range(256)) * 4096 * 4  # 4 MiB
    pieces = [body[i:i + 16384] for i in range(0, len(body), 16384)]
    bound = 32 * 1024

    async def answer(n: int, writer: asyncio.StreamWriter) -> None:
        writer.write(head(transfer_encoding="chunked"))
        for piece in pieces:
            writer.write(chunked([piece]).removesuffix(b"0\r\n\r\n"))
            await writer.drain()
        writer.write(b"0\r\n\r\n")

    async def scenario() -> tuple[bytes, int]:
        upstream = Upstream(connect_timeout_s=5, read_timeout_s=5, max_buffered=bound)
        got, most = [], 0
        async with RawServer(answer) as server:
            response = await upstream.post(server.url, "/", b"", [])
            while True:
                await asyncio.sleep(0.005)  # the reader is slower than the network
                most = max(most, response.buffered)
                chunk = await response.next_chunk()
                if not chunk:
                    break
                got.append(chunk)
            response.close()
        await upstream.close()
        return b"".join(got), most

    got, most = asyncio.run(scenario())
    assert got == body
    assert most <= bound + 256 * 1024  # the bound, overshot by at most one read


def test_a_refused_connection_is_connect_failed():
    async def scenario() -> None:
        server = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        server.close()
        await server.wait_closed()
        upstream = Upstream(connect_timeout_s=5, read_timeout_s=5)
        with pytest.raises(ConnectFailed):
            await upstream.post(f"http://127.0.0.1:{port}", "/", b"", [])

    asyncio.run(scenario())


def test_a_body_ended_by_closing_the_connection_is_whole_and_the_connection_not_reused():
    async def answer(n: int, writer: asyncio.StreamWriter) -> bool:
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n\r\n" + BODY)
        return False

    async def scenario() -> tuple[int, bytes, int]:
        upstream = Upstream(connect_timeout_s=5, read_timeout_s=5)
        async with RawServer(answer) as server:
            status, chunks = await _post(upstream, server)
            await _post(upstream, server)
        await upstream.close()
        return status, b"".join(chunks), server.connections

    assert asyncio.run(scenario()) == (200, BODY, 2)


def test_a_malformed_response_is_connection_lost():
    async def answer(n: int, writer: asyncio.StreamWriter) -> bool:
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\nzz\r\nnot hex\r\n")
        return None

    async def scenario() -> None:
        upstream = Upstream(connect_timeout_s=5, read_timeout_s=5)
        async with RawServer(answer) as server:
            with pytest.raises(ConnectionLost):
                await _post(upstream, server)
        await upstream.close()

    asyncio.run(scenario())
