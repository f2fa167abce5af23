"""The gateway's upstream connection pool against small scripted HTTP servers on loopback."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Awaitable, Callable

import pytest

from kunlun.http_client import (
    UpstreamBroken,
    UpstreamPool,
    UpstreamTimeout,
    UpstreamUnreachable,
)

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]
OK = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 2\r\n\r\n{}"


async def read_request(reader: asyncio.StreamReader) -> bytes:
    head = await reader.readuntil(b"\r\n\r\n")
    length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                  if line.lower().startswith(b"content-length"))  # fmt: skip
    return head + await reader.readexactly(length)


async def with_server(handler: Handler, client: Callable[[str], Awaitable[None]]) -> None:
    server = await asyncio.start_server(handler, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        await client(f"http://127.0.0.1:{port}")
    finally:
        server.close()


def test_connections_are_reused_and_stale_ones_replaced() -> None:
    connections: list[int] = []

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        connections.append(1)
        request = await read_request(reader)
        assert request.startswith(b"POST /v1/x HTTP/1.1\r\n") and request.endswith(b'{"a":1}')
        writer.write(OK)
        await read_request(reader)
        writer.write(OK)
        await writer.drain()
        writer.close()  # as a keep-alive timeout would, before a third request

    async def client(base_url: str) -> None:
        pool = UpstreamPool()
        for _ in range(3):
            response = await pool.post(base_url, "/v1/x", [], b'{"a":1}')
            assert response.status_code == 200 and response.header(b"content-length") == b"2"
            assert b"".join([c async for c in response.iter_raw()]) == b"{}"
            await response.close()
            await asyncio.sleep(0.05)
        await pool.close()

    asyncio.run(with_server(handler, client))
    assert len(connections) == 2  # two requests on the first, the third retried on a new one


def test_cut_off_chunked_body_raises_broken() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n5\r\nhello\r\n")
        await writer.drain()
        await asyncio.sleep(0.05)
        writer.transport.abort()

    async def client(base_url: str) -> None:
        pool = UpstreamPool()
        response = await pool.post(base_url, "/", [], b"")
        received = []
        with pytest.raises(UpstreamBroken):
            async for chunk in response.iter_raw():
                received.append(chunk)
        assert received == [b"hello"]
        await response.close()

    asyncio.run(with_server(handler, client))


def test_closing_an_unfinished_response_closes_the_connection() -> None:
    async def run() -> None:
        eof = asyncio.Event()

        async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await read_request(reader)
            writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n1\r\na\r\n")
            await writer.drain()
            if await reader.read() == b"":
                eof.set()

        async def client(base_url: str) -> None:
            pool = UpstreamPool()
            response = await pool.post(base_url, "/", [], b"")
            async for _ in response.iter_raw():
                break
            await response.close()
            await asyncio.wait_for(eof.wait(), 2)

        await with_server(handler, client)

    asyncio.run(run())


def test_nothing_listening_is_unreachable() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # bound, not listening: connections are refused

        async def client() -> None:
            with pytest.raises(UpstreamUnreachable, match=str(port)):
                await UpstreamPool().post(f"http://127.0.0.1:{port}", "/", [], b"")

        asyncio.run(client())


def test_server_closing_without_answer_on_a_fresh_connection_is_broken() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.close()

    async def client(base_url: str) -> None:
        with pytest.raises(UpstreamBroken, match="without answering"):
            await UpstreamPool().post(base_url, "/", [], b"")

    asyncio.run(with_server(handler, client))


def test_a_slow_reader_pauses_the_worker_side_and_gets_every_byte() -> None:
    from kunlun.http_client import HIGH_WATER_BYTES

    total = 8 * HIGH_WATER_BYTES
    piece = bytes(range(256)) * 256  # 64 KiB

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n" % total)
        for _ in range(total // len(piece)):
            writer.write(piece)
            await writer.drain()  # blocks while the gateway side has stopped reading
        writer.close()

    async def client(base_url: str) -> None:
        response = await UpstreamPool().post(base_url, "/", [], b"")
        received, largest = bytearray(), 0
        async for chunk in response.iter_raw():
            largest = max(largest, len(chunk))
            received += chunk
            await asyncio.sleep(0.01)  # a slow client
        assert len(received) == total and received == piece * (total // len(piece))
        # reading paused at the high-water mark: no piece is more than it plus one socket
        # read (256 KiB); without the pause the whole body would pile up
        assert largest <= HIGH_WATER_BYTES + 256 * 1024 < total
        await response.close()

    asyncio.run(with_server(handler, client))


def test_a_response_that_is_not_http_is_broken() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"SSH-2.0-OpenSSH_9.6\r\n")
        await writer.drain()
        await asyncio.sleep(1)

    async def client(base_url: str) -> None:
        with pytest.raises(UpstreamBroken, match="not valid HTTP"):
            await UpstreamPool().post(base_url, "/", [], b"")

    asyncio.run(with_server(handler, client))


def test_a_worker_silent_past_the_first_byte_timeout_times_out() -> None:
    release = asyncio.Event()

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        await release.wait()  # a stopped worker: the connection is open, nothing comes
        writer.close()

    async def client(base_url: str) -> None:
        pool = UpstreamPool(first_byte_timeout_s=0.2)
        with pytest.raises(UpstreamTimeout, match="no response within 0.2 s"):
            await pool.post(base_url, "/", [], b"")
        release.set()
        await pool.close()

    asyncio.run(with_server(handler, client))


def test_a_stream_silent_past_the_read_timeout_times_out_after_what_came() -> None:
    release = asyncio.Event()

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n5\r\nhello\r\n")
        await writer.drain()
        await release.wait()
        writer.close()

    async def client(base_url: str) -> None:
        pool = UpstreamPool(first_byte_timeout_s=30, read_timeout_s=0.2)
        response = await pool.post(base_url, "/", [], b"")
        received = []
        with pytest.raises(UpstreamTimeout, match="nothing more of its response for 0.2 s"):
            async for chunk in response.iter_raw():
                received.append(chunk)
        assert received == [b"hello"]
        await response.close()
        release.set()
        await pool.close()

    asyncio.run(with_server(handler, client))


def test_a_slow_but_steady_stream_does_not_time_out() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
        for _ in range(6):  # longer in total than the read timeout, never silent that long
            writer.write(b"1\r\nx\r\n")
            await writer.drain()
            await asyncio.sleep(0.1)
        writer.write(b"0\r\n\r\n")
        await writer.drain()

    async def client(base_url: str) -> None:
        pool = UpstreamPool(first_byte_timeout_s=30, read_timeout_s=5)
        response = await pool.post(base_url, "/", [], b"")
        assert b"".join([c async for c in response.iter_raw()]) == b"x" * 6
        await response.close()
        await pool.close()

    asyncio.run(with_server(handler, client))
