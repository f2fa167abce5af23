"""Direct streams: a local worker writes a streamed answer to the client's own connection.

The gateway relays every other answer byte for byte (:mod:`kunlun.serving.relay`). A
streamed completion or chat completion to a worker on this node skips that relay: the
gateway has read the request, checked its key, admitted and routed it, and hands it to the
worker over a Unix socket together with a duplicate of the client's connection (its file
descriptor, ``SCM_RIGHTS``). The worker runs it through its own app as if it had come over
HTTP, and the exchange goes:

1. gateway -> worker: the request (its path, headers and body) with the client's socket;
2. worker -> gateway: ``S``, the answer's status and headers. Without a ``Content-Length``
   (a stream) the answer is *direct*: the gateway writes the head to the client itself (its
   HTTP/1.1 server frames the body as chunks) and, once the head has left, sends ``G``;
3. the worker writes each piece of the body to the client's socket as one HTTP chunk,
   from its own event loop: no second process wakes per token; a plain stream's events
   after its first are written by the worker's engine thread right after its step
   (``worker_stream.EngineWrites``), so not even the worker's event loop wakes per token;
4. worker -> gateway: ``P`` at the first piece and then at most once per third of the
   gateway's read timeout while pieces leave (so its silence backstop holds, within a third
   more than the timeout, without a wake-up per token), and ``E``, the end (when the first piece left; whether an error event
   ended the stream); the gateway writes the closing chunk and the connection is its own
   again, kept alive for the client's next request. A chunk the client's connection takes
   only in part (the client reads slower than the stream comes) is bracketed by ``H``
   (from its first part on, the connection is inside a chunk) and ``W`` (whole again): a
   worker that dies or goes silent between them leaves a chunk the gateway cannot finish,
   so it shuts the connection down instead of writing its error event into the middle of
   that chunk, and the client sees a body cut off, not one spliced together.

An answer with a ``Content-Length`` (a refusal) comes back to the gateway as ``B`` pieces
and is relayed as before. The gateway closing the Unix socket means the client left: the
worker cancels the request, which aborts its generation. The worker dying ends the client's
stream with the relay's error event. Only one side writes to the client's connection at a
time: the gateway's head before ``G``, the worker's chunks until ``E``, the gateway's last
chunk after it.

:func:`client_socket` finds the client's connection under uvicorn's ``send``;
:class:`DirectLink` is the gateway's side,
:class:`~kunlun.serving.handoff_worker.HandoffServer` the worker's.
"""

from __future__ import annotations

import array
import asyncio
import contextlib
import json
import os
import socket
import struct
from typing import Any

from starlette.types import ASGIApp, Receive, Scope, Send

from kunlun.http_client import UpstreamBroken, UpstreamTimeout, UpstreamUnreachable

CLIENT_SOCKET_SCOPE = "kunlun.client_socket"
"""Where :class:`ClientSocketScope` puts the client connection's transport in the scope."""
DIRECT_WRITER_SCOPE = "kunlun.direct_writer"
"""Where the worker's side puts, in a handed-off request's scope, what writes a piece of a
direct answer from the engine thread (``handoff_worker._Exchange.write_now``)."""
START, BODY, PROGRESS, END, GO = b"S", b"B", b"P", b"E", b"G"
"""The frames' kinds (worker -> gateway ``S``, ``B``, ``P``, ``E``; gateway -> worker
``G``)."""
INSIDE_CHUNK, WHOLE = b"H", b"W"
"""Worker -> gateway: a chunk is partly written to the client's connection (``H``), and
finished (``W``)."""
HEAD = struct.Struct(">cI")
"""A worker frame's head: its kind and its payload's length."""
LENGTH = struct.Struct(">I")
MAX_META_BYTES = 1 << 20
"""The largest request head (path and headers, JSON) a worker takes."""
MAX_BODY_BYTES = 64 << 20
"""The largest request body a worker takes this way (the gateway's own limit is lower)."""
FLUSH_POLL_S = 0.001
"""How often the gateway looks whether the answer's head has left, before sending ``G``."""


def headers_json(headers: list[tuple[bytes, bytes]]) -> list[list[str]]:
    """HTTP headers as a frame's JSON carries them (latin-1, as HTTP/1.1 defines them)."""
    return [[k.decode("latin-1"), v.decode("latin-1")] for k, v in headers]


def headers_from_json(items: list[list[str]]) -> list[tuple[bytes, bytes]]:
    """The headers of :func:`headers_json` back."""
    return [(k.encode("latin-1"), v.encode("latin-1")) for k, v in items]


def client_socket(scope: Scope) -> Any | None:
    """The transport of ``scope``'s client connection, when the worker may write to it:
    plain (no TLS) HTTP/1.1 under uvicorn, found by :class:`ClientSocketScope`."""
    return scope.get(CLIENT_SOCKET_SCOPE)


def relayed_only(scope: Scope) -> None:
    """Every answer to ``scope`` passes through the gateway: called by a layer that reads
    the answer's body (a key's token charge settled from the usage at its end) or sends it
    somewhere other than the client's connection (an endpoint call's answer, reshaped)."""
    scope.pop(CLIENT_SOCKET_SCOPE, None)


class ClientSocketScope:
    """ASGI wrapper, outermost under uvicorn: records the client connection's transport
    (``CLIENT_SOCKET_SCOPE``) for :class:`DirectLink`, from the request cycle uvicorn's
    ``send`` is a method of, when the connection is plain HTTP/1.1."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope.get("http_version") == "1.1":
            transport = getattr(getattr(send, "__self__", None), "transport", None)
            if (
                transport is not None
                and transport.get_extra_info("sslcontext") is None
                and transport.get_extra_info("socket") is not None
            ):
                scope[CLIENT_SOCKET_SCOPE] = transport
        await self.app(scope, receive, send)


# ---- the gateway's side ----


class DirectLink:
    """The gateway's end of one handed-off request (:meth:`open`, then :meth:`start`;
    :meth:`go` and :meth:`end` for a direct answer, :meth:`pieces` for one relayed)."""

    def __init__(self, sock: socket.socket, read_timeout_s: float | None = None) -> None:
        self.sock, self.read_timeout_s = sock, read_timeout_s
        self._buffer = bytearray()
        self.inside_chunk = False
        """Whether the worker last said it is inside a chunk (``H`` without its ``W``): the
        client's connection then ends in part of a chunk, and nothing can follow it."""

    @classmethod
    async def open(
        cls,
        address: str,
        transport: Any,
        path: str,
        headers: list[tuple[bytes, bytes]],
        body: bytes,
        connect_timeout_s: float,
        read_timeout_s: float | None,
    ) -> DirectLink:
        """Connect to the worker at ``address`` and send it the request with the client's
        socket; :class:`UpstreamUnreachable` when the worker takes no connection (nothing
        was sent). ``read_timeout_s``: the longest silence of the body :meth:`end` allows."""
        progress_s = None if read_timeout_s is None else read_timeout_s / 3
        loop = asyncio.get_running_loop()
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.setblocking(False)
        try:
            await asyncio.wait_for(loop.sock_connect(sock, "\0" + address), connect_timeout_s)
        except (OSError, TimeoutError) as exc:
            sock.close()
            raise UpstreamUnreachable(
                f"the worker's direct-stream socket @{address}: {type(exc).__name__}: {exc}"
            ) from None
        meta = json.dumps({"path": path, "body_bytes": len(body), "progress_s": progress_s,
                           "headers": headers_json(headers)}).encode()  # fmt: skip
        fd = transport.get_extra_info("socket").fileno()
        try:
            # the client's socket rides on the first bytes; a fresh Unix socket takes them
            sock.sendmsg([LENGTH.pack(len(meta))],
                         [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [fd]))])  # fmt: skip
            await loop.sock_sendall(sock, meta + body)
        except OSError as exc:
            sock.close()
            raise UpstreamBroken(f"sending the request to the worker failed: {exc}") from None
        return cls(sock, read_timeout_s)

    async def _fill(self, n: int) -> None:
        """Until ``n`` bytes are buffered (nothing is taken: a wait cancelled halfway through
        a frame leaves it whole for the next reader)."""
        loop = asyncio.get_running_loop()
        while len(self._buffer) < n:
            try:
                data = await loop.sock_recv(self.sock, max(65536, n - len(self._buffer)))
            except OSError as exc:
                raise UpstreamBroken(f"connection to the worker failed: {exc}") from None
            if not data:
                raise UpstreamBroken("connection to the worker failed: closed by the worker")
            self._buffer += data

    def _take_frame(self) -> tuple[bytes, bytes] | None:
        """The next frame if the buffer holds all of it."""
        if len(self._buffer) < HEAD.size:
            return None
        kind, length = HEAD.unpack(self._buffer[: HEAD.size])
        if len(self._buffer) < HEAD.size + length:
            return None
        payload = bytes(self._buffer[HEAD.size : HEAD.size + length])
        del self._buffer[: HEAD.size + length]
        return kind, payload

    async def frame(self) -> tuple[bytes, bytes]:
        """The worker's next frame: ``(kind, payload)``."""
        await self._fill(HEAD.size)
        await self._fill(HEAD.size + HEAD.unpack(self._buffer[: HEAD.size])[1])
        taken = self._take_frame()
        assert taken is not None
        return taken

    def end_if_here(self) -> dict[str, Any] | None:
        """The end of a direct answer if it has already arrived, read without waiting (a
        loop that runs its timers before its reads may not have read it yet)."""
        with contextlib.suppress(BlockingIOError, InterruptedError, OSError):
            while data := self.sock.recv(65536, socket.MSG_DONTWAIT):
                self._buffer += data
        while (taken := self._take_frame()) is not None:
            if taken[0] == END:
                result: dict[str, Any] = json.loads(taken[1])
                return result
            if taken[0] in (INSIDE_CHUNK, WHOLE):
                self.inside_chunk = taken[0] == INSIDE_CHUNK
        return None

    async def start(self, timeout_s: float | None) -> tuple[int, list[tuple[bytes, bytes]], bool]:
        """The answer's status, headers and whether it is direct (the worker writes it)."""
        try:
            kind, payload = await asyncio.wait_for(self.frame(), timeout_s)
        except TimeoutError:
            raise UpstreamTimeout(
                f"the worker sent no response head within {timeout_s:g} s "
                "(upstream first-byte timeout)"
            ) from None
        if kind != START:
            raise UpstreamBroken(f"the worker answered with frame {kind!r} before its head")
        head = json.loads(payload)
        headers = headers_from_json(head["headers"])
        return int(head["status"]), headers, bool(head["direct"])

    def go(self) -> None:
        """Tell the worker the head has left: it writes the body from now on."""
        self.sock.send(GO)  # one byte on an otherwise idle socket: never blocks

    async def end(self) -> dict[str, Any]:
        """The end of a direct answer: ``first_byte`` (``time.perf_counter`` of its first
        piece, the same clock in every process here) and ``error_event``, or
        ``client_gone`` when a write to the client's connection failed;
        :class:`UpstreamTimeout` after a silence longer than the read timeout."""
        timeout = None if self.read_timeout_s is None else self.read_timeout_s * 4 / 3
        while True:
            try:
                kind, payload = await asyncio.wait_for(self.frame(), timeout)
            except TimeoutError:
                raise UpstreamTimeout(
                    f"the worker sent nothing more of its response for "
                    f"{self.read_timeout_s:g} s (upstream read timeout)"
                ) from None
            if kind == END:
                result: dict[str, Any] = json.loads(payload)
                return result
            if kind in (INSIDE_CHUNK, WHOLE):
                self.inside_chunk = kind == INSIDE_CHUNK
            elif kind != PROGRESS:
                raise UpstreamBroken(f"the worker sent frame {kind!r} into a direct answer")

    async def pieces(self) -> Any:
        """The pieces of a relayed answer's body, until its end."""
        while True:
            kind, payload = await self.frame()
            if kind == END:
                return
            yield payload

    def close(self) -> None:
        """Done, or the client left (the worker then cancels the request)."""
        self.sock.close()


async def wait_flushed(transport: Any) -> bool:
    """Until everything written to ``transport`` has left for the client (True), or the
    connection closed (False)."""
    while transport.get_write_buffer_size():
        if transport.is_closing():
            return False
        await asyncio.sleep(FLUSH_POLL_S)
    return not transport.is_closing()


def shut(transport: Any) -> None:
    """Shut the client's connection down for every process holding it (a worker that was
    silent past the read timeout may still hold a duplicate and wake up later)."""
    fd = transport.get_extra_info("socket").fileno()
    with contextlib.suppress(OSError):
        sock = socket.socket(fileno=os.dup(fd))
        try:
            sock.shutdown(socket.SHUT_RDWR)
        finally:
            sock.close()
