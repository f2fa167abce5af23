"""Keep-alive HTTP/1.1 connections: the gateway's to its engine workers (and to other
cluster nodes' peer ports), and ``kunlun-cli bench``'s to the endpoint it loads.

The gateway's hot path: each request is one write on a pooled loopback connection, and the
response is parsed by ``httptools`` (the C parser uvicorn uses) straight from the
connection's ``data_received`` callback: no stream reader, no per-event Python parsing.
Measured in the gateway benchmark's process, the pure-Python ``h11`` parser this replaced
took about as much CPU as the socket writes themselves, and ``httpx`` about four times that.
It speaks only what workers and OpenAI-compatible servers answer: one request at a time per
connection, ``Content-Length`` or chunked bodies.

Errors: :class:`UpstreamUnreachable` when no connection could be made (nothing was sent);
:class:`UpstreamBroken` when the connection failed after the request was sent;
:class:`UpstreamTimeout` (a kind of broken) when the worker sent no response head within
``first_byte_timeout_s`` of the request, or nothing more of the body for ``read_timeout_s``.
Both are generous backstops (a worker sends the head of a non-streamed response only once
its generation is done); the node agent's liveness probe is what notices a stopped worker
fast.
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
import time
from collections.abc import AsyncIterator
from urllib.parse import urlsplit

import httptools

HIGH_WATER_BYTES = 256 * 1024
"""Response bytes buffered for a slow client before reading from the worker pauses."""


_Key = tuple[str, int, bool]
"""Where a pooled connection goes: host, port, and whether it speaks TLS."""


class UpstreamError(Exception):
    """The exchange with a worker failed at the connection level."""


class UpstreamUnreachable(UpstreamError):
    """No connection to the worker could be made; the request was not sent."""


class UpstreamBroken(UpstreamError):
    """The connection failed after the request was sent (the worker may have died)."""


class UpstreamTimeout(UpstreamBroken):
    """The worker sent nothing within the first-byte or read timeout."""


class _Stale(Exception):
    """A pooled connection was closed by the worker before any answer."""


class _Connection(asyncio.Protocol):
    """One connection to a worker and the response being received on it.

    ``httptools`` calls :meth:`on_header`, :meth:`on_headers_complete`, :meth:`on_body` and
    :meth:`on_message_complete` from inside :meth:`data_received`; the consumer waits on
    :meth:`wait` for what they record."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.error: str | None = None
        self.idle_since = 0.0
        self._waiter: asyncio.Future[bool] | None = None
        self._paused = False
        self._reset()

    def _reset(self) -> None:
        self.parser = httptools.HttpResponseParser(self)
        self.received = 0
        self.status_code: int | None = None
        self.headers: list[tuple[bytes, bytes]] = []
        self.pieces: list[bytes] = []
        self.buffered = 0
        self.complete = False
        self.keep_alive = False

    # ---- asyncio.Protocol ----
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self.received += len(data)
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self.error = f"the server's response is not valid HTTP: {exc}"
            self.close()
        if self.buffered >= HIGH_WATER_BYTES and not self._paused and self.transport:
            self._paused = True
            self.transport.pause_reading()
        self._wake()

    def eof_received(self) -> bool:
        return False  # close the transport: connection_lost follows

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self.error is None and not self.complete:
            reason = f"{type(exc).__name__}: {exc}" if exc else "closed by the server"
            self.error = f"connection to the server failed: {reason}"
        self._wake()

    # ---- httptools callbacks ----
    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name.lower(), value))

    def on_headers_complete(self) -> None:
        self.status_code = self.parser.get_status_code()

    def on_body(self, body: bytes) -> None:
        self.pieces.append(body)
        self.buffered += len(body)

    def on_message_complete(self) -> None:
        self.complete = True
        self.keep_alive = self.parser.should_keep_alive()  # llhttp forgets it afterwards

    # ---- for the consumer ----
    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(True)

    async def wait(self, timeout_s: float | None = None) -> bool:
        """Until something more arrived or the connection ended (True), or ``timeout_s``
        passed first (False)."""
        loop = asyncio.get_running_loop()
        waiter: asyncio.Future[bool] = loop.create_future()
        self._waiter = waiter
        timer = None if timeout_s is None else loop.call_later(timeout_s, _expire, waiter)
        try:
            return await waiter
        finally:
            self._waiter = None
            if timer is not None:
                timer.cancel()

    def take_body(self) -> bytes:
        """Everything received of the body and not yet taken, as one piece."""
        pieces, self.pieces, self.buffered = self.pieces, [], 0
        if self._paused and self.transport is not None and not self.closed:
            self._paused = False
            self.transport.resume_reading()
        return pieces[0] if len(pieces) == 1 else b"".join(pieces)

    def reusable(self, now: float, idle_timeout_s: float) -> bool:
        return not self.closed and now - self.idle_since < idle_timeout_s

    def close(self) -> None:
        if self.transport is not None:
            with contextlib.suppress(Exception):
                self.transport.close()


class UpstreamResponse:
    """A response being received: status and headers now, the body by :meth:`iter_raw`.
    Always :meth:`close` it: a complete response returns its connection to the pool, an
    incomplete one closes it (which tells the worker that nobody is listening)."""

    def __init__(self, pool: UpstreamPool, key: _Key, connection: _Connection) -> None:
        self._pool, self._key, self._connection = pool, key, connection
        self.status_code: int = connection.status_code or 0
        self.headers: list[tuple[bytes, bytes]] = connection.headers

    @property
    def complete(self) -> bool:
        """Whether the whole body has arrived and been taken by :meth:`iter_raw`."""
        connection = self._connection
        return connection is not None and connection.complete and not connection.pieces

    def header(self, name: bytes) -> bytes | None:
        return next((v for k, v in self.headers if k == name), None)

    async def iter_raw(self) -> AsyncIterator[bytes]:
        """The body as it arrives (transfer framing removed); everything already received
        comes as one piece. Raises :class:`UpstreamBroken` if the connection breaks."""
        connection, timeout_s = self._connection, self._pool.read_timeout_s
        while True:
            if connection.pieces:
                yield connection.take_body()
            elif connection.complete:
                return
            elif connection.error is not None:
                raise UpstreamBroken(f"the server's response was cut off: {connection.error}")
            elif not await connection.wait(timeout_s):
                raise UpstreamTimeout(
                    f"the server sent nothing more of its response for {timeout_s:g} s "
                    "(upstream read timeout)"
                )

    async def close(self) -> None:
        connection, self._connection = self._connection, None  # type: ignore[assignment]
        if connection is None:
            return
        if connection.complete and connection.keep_alive and not connection.closed:
            self._pool._release(self._key, connection)
        else:
            connection.close()


class UpstreamPool:
    """Pooled connections to workers, by host and port. Safe within one event loop."""

    def __init__(self, connect_timeout_s: float = 5.0, idle_timeout_s: float = 20.0,
                 max_idle_per_host: int = 256, first_byte_timeout_s: float | None = None,
                 read_timeout_s: float | None = None,
                 ssl_context: ssl.SSLContext | None = None) -> None:  # fmt: skip
        self.connect_timeout_s = connect_timeout_s
        self.ssl_context = ssl_context
        """For ``https://`` base URLs (another cluster node's peer port): the cluster CA and
        this node's certificate. None: ``https://`` is refused."""
        self.first_byte_timeout_s = first_byte_timeout_s
        """Longest wait for a response's head after sending the request (None: no limit)."""
        self.read_timeout_s = read_timeout_s
        """Longest silence between two pieces of a response body (None: no limit)."""
        self.idle_timeout_s = idle_timeout_s
        """Idle connections older than this are not reused (keep it under the worker's
        keep-alive timeout)."""
        self.max_idle_per_host = max_idle_per_host
        self._idle: dict[_Key, list[_Connection]] = {}
        self._addresses: dict[str, tuple[_Key, bytes, str]] = {}

    async def post(self, base_url: str, path: str, headers: list[tuple[bytes, bytes]],
                   body: bytes) -> UpstreamResponse:  # fmt: skip
        """Send ``POST base_url+path`` and wait for the response's status and headers.

        Header values must not hold CR or LF (the caller's own values; a client's header
        arrives already parsed). A pooled connection the worker closed meanwhile (nothing
        came back) is retried once on a fresh connection."""
        key, host, prefix = self._address(base_url)
        head = [b"POST ", (prefix + path).encode(), b" HTTP/1.1\r\nhost: ", host,
                b"\r\ncontent-length: ", b"%d" % len(body), b"\r\n"]  # fmt: skip
        for name, value in headers:
            head += (name, b": ", value, b"\r\n")
        head.append(b"\r\n")
        request = b"".join(head) + body
        connection = self._take(key)
        if connection is not None:
            try:
                return await self._exchange(key, connection, request)
            except _Stale:
                pass
        connection = await self._connect(key)
        try:
            return await self._exchange(key, connection, request)
        except _Stale:
            raise UpstreamBroken("the server closed the connection without answering") from None

    async def close(self) -> None:
        idle, self._idle = self._idle, {}
        for connections in idle.values():
            for connection in connections:
                connection.close()

    # ---- internals ----
    def _address(self, base_url: str) -> tuple[_Key, bytes, str]:
        """Host, port and TLS of ``base_url``, its ``host`` header, and its path (a prefix
        for every request: a remote replica's is ``/cluster/replicas/<id>``)."""
        address = self._addresses.get(base_url)
        if address is None:
            parts = urlsplit(base_url)
            tls = parts.scheme == "https"
            key = (parts.hostname or "127.0.0.1", parts.port or (443 if tls else 80), tls)
            address = (key, f"{key[0]}:{key[1]}".encode(), parts.path.rstrip("/"))
            self._addresses[base_url] = address
        return address

    def _take(self, key: _Key) -> _Connection | None:
        idle = self._idle.get(key)
        now = time.monotonic()
        while idle:
            connection = idle.pop()
            if connection.reusable(now, self.idle_timeout_s):
                return connection
            connection.close()
        return None

    def _release(self, key: _Key, connection: _Connection) -> None:
        idle = self._idle.setdefault(key, [])
        if len(idle) >= self.max_idle_per_host:
            connection.close()
            return
        connection.idle_since = time.monotonic()
        idle.append(connection)

    async def _connect(self, key: _Key) -> _Connection:
        loop = asyncio.get_running_loop()
        host, port, tls = key
        if tls and self.ssl_context is None:
            raise UpstreamUnreachable(f"https://{host}:{port} needs the cluster's certificates")
        try:
            _, connection = await asyncio.wait_for(
                loop.create_connection(_Connection, host, port,
                                       ssl=self.ssl_context if tls else None),
                self.connect_timeout_s,
            )  # fmt: skip
        except (OSError, TimeoutError) as exc:
            raise UpstreamUnreachable(
                f"cannot connect to {key[0]}:{key[1]}: {type(exc).__name__}: {exc}"
            ) from None
        return connection

    async def _exchange(
        self, key: _Key, connection: _Connection, request: bytes
    ) -> UpstreamResponse:
        connection._reset()
        limit = self.first_byte_timeout_s
        try:
            if connection.transport is None or connection.closed:
                raise _Stale()
            connection.transport.write(request)
            deadline = None if limit is None else time.monotonic() + limit
            while connection.status_code is None:
                if connection.error is not None:
                    if connection.closed and not connection.received:
                        raise _Stale()
                    raise UpstreamBroken(
                        f"the server's response was cut off or invalid: {connection.error}"
                    )
                left = None if deadline is None else max(0.0, deadline - time.monotonic())
                if not await connection.wait(left):
                    raise UpstreamTimeout(
                        f"the server sent no response within {limit:g} s of the request "
                        "(upstream first-byte timeout)"
                    )
            return UpstreamResponse(self, key, connection)
        except BaseException:
            connection.close()
            raise


def _expire(waiter: asyncio.Future[bool]) -> None:
    if not waiter.done():
        waiter.set_result(False)
