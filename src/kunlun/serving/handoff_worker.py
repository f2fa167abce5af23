"""The worker's side of direct streams (:mod:`kunlun.serving.handoff`): its Unix socket,
where the gateway hands it requests with their clients' sockets (:class:`HandoffServer`), and
one such request run through the worker's app (``_Exchange``)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import socket
import time
from collections.abc import Callable
from typing import Any

from starlette.requests import ClientDisconnect
from starlette.types import ASGIApp, Message, Scope

from kunlun.protocol import sse
from kunlun.serving.handoff import (
    BODY,
    DIRECT_WRITER_SCOPE,
    END,
    GO,
    HEAD,
    INSIDE_CHUNK,
    LENGTH,
    MAX_BODY_BYTES,
    MAX_META_BYTES,
    PROGRESS,
    START,
    WHOLE,
    headers_from_json,
    headers_json,
)

ACCEPT_RETRY_S = 0.1
"""How long the worker waits before accepting again after a failed accept."""


class HandoffServer:
    """The worker's Unix socket (abstract: nothing on disk, gone with the process) where
    the gateway hands it requests with their clients' sockets; each runs through ``app``."""

    def __init__(self, app: ASGIApp, log: Callable[[str], None]) -> None:
        self.app, self.log = app, log
        self.address = f"kunlun-worker-{os.getpid()}-{os.urandom(6).hex()}"
        """The socket's abstract name (without its leading NUL), for the ready file."""
        self._sock: socket.socket | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    def start(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.bind("\0" + self.address)
        sock.listen(socket.SOMAXCONN)
        sock.setblocking(False)
        self._sock = sock
        self._spawn(self._accept())

    def _spawn(self, work: Any) -> None:
        task = asyncio.ensure_future(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _accept(self) -> None:
        loop = asyncio.get_running_loop()
        assert self._sock is not None
        while True:
            try:
                conn, _ = await loop.sock_accept(self._sock)
            except OSError as exc:  # out of descriptors, say: the gateway's wait times out
                self.log(f"direct stream: accepting a hand-off failed: {exc}")
                await asyncio.sleep(ACCEPT_RETRY_S)
                continue
            conn.setblocking(False)
            self._spawn(self._serve(conn))

    async def _serve(self, conn: socket.socket) -> None:
        client: socket.socket | None = None
        try:
            meta, body, client = await _receive_request(conn)
            await _Exchange(conn, client, self.app).run(meta, body)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a bad hand-off: said once, the gateway sees the close
            self.log(f"direct stream: {type(exc).__name__}: {exc}")
        finally:
            conn.close()
            if client is not None:
                client.close()  # our duplicate only: the gateway keeps the connection


async def _receive_request(conn: socket.socket) -> tuple[dict[str, Any], bytes, socket.socket]:
    """The request the gateway sent on ``conn``: its head, its body and the client's socket."""
    loop = asyncio.get_running_loop()
    await _ready(conn.fileno(), writable=False)
    data, fds, _, _ = socket.recv_fds(conn, LENGTH.size, 1)
    if not fds:
        raise ValueError("the hand-off carried no client socket")
    client = socket.socket(fileno=fds[0])
    for extra in fds[1:]:
        os.close(extra)
    buffer = bytearray(data)
    need = LENGTH.size
    while True:
        if len(buffer) >= need:
            if need == LENGTH.size:
                (meta_bytes,) = LENGTH.unpack(buffer[: LENGTH.size])
                if meta_bytes > MAX_META_BYTES:
                    raise ValueError(f"a request head of {meta_bytes} bytes")
                need += meta_bytes
                continue
            break
        chunk = await loop.sock_recv(conn, 65536)
        if not chunk:
            raise ValueError("the gateway closed the hand-off before the whole request")
        buffer += chunk
    meta = json.loads(buffer[LENGTH.size : need])
    body_bytes = int(meta["body_bytes"])
    if not 0 <= body_bytes <= MAX_BODY_BYTES:
        raise ValueError(f"a request body of {body_bytes} bytes")
    while len(buffer) < need + body_bytes:
        chunk = await loop.sock_recv(conn, max(65536, need + body_bytes - len(buffer)))
        if not chunk:
            raise ValueError("the gateway closed the hand-off before the whole request")
        buffer += chunk
    return meta, bytes(buffer[need : need + body_bytes]), client


class _Exchange:
    """One handed-off request run through the worker's app."""

    def __init__(self, conn: socket.socket, client: socket.socket, app: ASGIApp) -> None:
        self.conn, self.client, self.app = conn, client, app
        self.loop = asyncio.get_running_loop()
        self.direct = False
        self.go: asyncio.Future[None] = self.loop.create_future()
        self.gone = asyncio.Event()
        self.first_byte: float | None = None
        self.error_event = False
        self.progress_s: float | None = None
        self.progress_at = 0.0
        self.written = False
        """Whether the event loop has written the answer's first piece: from then on the
        engine thread may write pieces (:meth:`write_now`)."""
        self.rest = b""
        """What the client's connection did not take of a piece the engine thread wrote:
        the event loop writes it before its next piece."""

    async def run(self, meta: dict[str, Any], body: bytes) -> None:
        progress = meta.get("progress_s")
        self.progress_s = None if progress is None else float(progress)
        headers = headers_from_json(meta["headers"])
        headers.append((b"content-length", str(len(body)).encode()))
        path = str(meta["path"])
        scope: Scope = {
            "type": "http", "asgi": {"version": "3.0", "spec_version": "2.4"},
            "http_version": "1.1", "method": "POST", "scheme": "http", "path": path,
            "raw_path": path.encode(), "query_string": b"", "root_path": "",
            "headers": headers, "client": ("127.0.0.1", 0), "server": ("127.0.0.1", 0),
            "state": {}, DIRECT_WRITER_SCOPE: self,
        }  # fmt: skip
        sent = False

        async def receive() -> Message:
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": body, "more_body": False}
            await self.gone.wait()
            return {"type": "http.disconnect"}

        app = asyncio.ensure_future(self.app(scope, receive, self._send))
        watch = asyncio.ensure_future(self._watch(app))
        try:
            await app
        except asyncio.CancelledError:
            if not self.gone.is_set():
                raise
            return  # the client left: the app has aborted the request
        except (OSError, ClientDisconnect):  # a write to the client's connection failed
            with contextlib.suppress(OSError):  # the gateway may have closed first
                await self._frame(END, json.dumps({"client_gone": True}).encode())
            return
        finally:
            watch.cancel()
        await self._frame(END, json.dumps({"first_byte": self.first_byte,
                                           "error_event": self.error_event}).encode())  # fmt: skip

    async def _watch(self, app: asyncio.Future[None]) -> None:
        """Read the gateway's ``G``, then wait for its close (the client left): cancel."""
        while True:
            try:
                data = await self.loop.sock_recv(self.conn, 64)
            except OSError:
                data = b""
            if not data:
                self.gone.set()
                if not self.go.done():
                    self.go.set_exception(ConnectionResetError("the client left"))
                    self.go.exception()  # retrieved: nobody may be waiting
                app.cancel()
                return
            if GO in data and not self.go.done():
                self.go.set_result(None)

    async def _frame(self, kind: bytes, payload: bytes) -> None:
        await self.loop.sock_sendall(self.conn, HEAD.pack(kind, len(payload)) + payload)

    async def _send(self, message: Message) -> None:
        if message["type"] == "http.response.start":
            headers = [(bytes(k), bytes(v)) for k, v in message.get("headers", [])]
            self.direct = not any(k.lower() == b"content-length" for k, _ in headers)
            head = {"status": message["status"], "direct": self.direct,
                    "headers": headers_json(headers)}  # fmt: skip
            await self._frame(START, json.dumps(head).encode())
            if self.direct:
                await self.go
            return
        if message["type"] != "http.response.body":
            return
        piece = bytes(message.get("body", b""))
        if not self.direct:
            if piece:
                await self._frame(BODY, piece)
            return
        if not piece:
            return  # the closing chunk is the gateway's
        now = time.perf_counter()
        first = self.first_byte is None
        if first:
            self.first_byte = now
        if sse.ERROR_EVENT_START in piece:
            self.error_event = True
        if self.rest:  # the end of the engine thread's last piece goes first
            rest, self.rest = self.rest, b""
            await self._write_chunk(rest, started=True)
        await self._write_chunk(_chunk(piece))
        self.written = True
        if self.progress_s is not None and (first or now - self.progress_at >= self.progress_s):
            self.progress_at = now
            await self._frame(PROGRESS, b"")

    def write_now(self, piece: bytes) -> bool:
        """On the engine thread, between the event loop's pieces: ``piece`` as one chunk to
        the client's connection, if it takes at least part of it now (True; what it does not
        take the event loop writes before its next piece). False, nothing written: the
        connection is full or gone, or the event loop has not written the first piece or
        still has some of one to write; the event loop writes this piece and says what
        happened."""
        if not self.written or self.rest or self.gone.is_set():
            return False
        chunk = _chunk(piece)
        try:
            sent = self.client.send(chunk)
        except OSError:  # full (BlockingIOError) or failed: the event loop's write will tell
            return False
        if sent < len(chunk):
            self.rest = chunk[sent:]
        now = time.perf_counter()
        if self.progress_s is not None and now - self.progress_at >= self.progress_s:
            # the gateway hears the answer is alive, as from the loop; a few bytes to a
            # reader are taken whole or not at all, and one not taken is tried again next time
            with contextlib.suppress(OSError):
                self.conn.send(HEAD.pack(PROGRESS, 0))
                self.progress_at = now
        return True

    async def _write_chunk(self, chunk: bytes, started: bool = False) -> None:
        """``chunk`` to the client's connection. One the connection takes only in part (the
        client reads slower than the stream comes) is bracketed by ``H`` and ``W`` to the
        gateway, which must not write into the middle of it should this process die;
        ``started``: the rest of a chunk begun already."""
        view, sent, inside = memoryview(chunk), 0, False
        if started:
            inside = True
            await self._frame(INSIDE_CHUNK, b"")
        while True:
            with contextlib.suppress(BlockingIOError, InterruptedError):
                sent += self.client.send(view[sent:])
            if sent == len(chunk):
                break
            if sent and not inside:  # part of it has left: inside a chunk until it all has
                inside = True
                await self._frame(INSIDE_CHUNK, b"")
            await _ready(self.client.fileno(), writable=True)  # or failed: the send says
        if inside:
            await self._frame(WHOLE, b"")


def _chunk(piece: bytes) -> bytes:
    """``piece`` as one HTTP/1.1 chunk."""
    return b"%x\r\n%b\r\n" % (len(piece), piece)


async def _ready(fd: int, writable: bool) -> None:
    """Until ``fd`` is readable (``writable``: takes more)."""
    loop = asyncio.get_running_loop()
    ready: asyncio.Future[None] = loop.create_future()

    def wake() -> None:
        if not ready.done():
            ready.set_result(None)

    add, remove = (
        (loop.add_writer, loop.remove_writer) if writable else (loop.add_reader, loop.remove_reader)
    )
    add(fd, wake)
    try:
        await ready
    finally:
        remove(fd)
