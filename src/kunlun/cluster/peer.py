"""The peer port: how other nodes reach this node's replicas.

``POST /cluster/replicas/<replica>/<path>`` is relayed byte for byte to that local worker's
``<path>`` (the calling node's gateway has already checked the key, admitted and queued the
request); ``GET /cluster/health`` answers the node's name. With the cluster's certificates it
speaks TLS only and requires a client certificate from the cluster CA: a caller with another
CA's certificate is refused in the handshake. It runs in its own thread and event loop,
apart from the API's.
"""

from __future__ import annotations

import asyncio
import json
import socket
import ssl
import threading
from typing import Any

import uvicorn
from starlette.types import Receive, Scope, Send

from kunlun.http_client import UpstreamError, UpstreamPool
from kunlun.serving.replica import ReplicaSet

PREFIX = "/cluster/replicas/"


class PeerApp:
    def __init__(self, node: str, replicas: ReplicaSet) -> None:
        self.node, self.replicas = node, replicas
        self.pool: UpstreamPool | None = None
        self.in_flight: dict[str, int] = {}
        """Requests being relayed, by replica (read by the node's drain before a stop)."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            while (message := await receive())["type"] != "lifespan.shutdown":
                if message["type"] == "lifespan.startup":
                    self.pool = UpstreamPool()
                    await send({"type": "lifespan.startup.complete"})
            if self.pool is not None:
                await self.pool.close()
            await send({"type": "lifespan.shutdown.complete"})
            return
        if scope["type"] != "http":
            return
        path: str = scope["path"]
        if scope["method"] == "GET" and path == "/cluster/health":
            await _answer(send, 200, {"node": self.node})
            return
        if scope["method"] != "POST" or not path.startswith(PREFIX):
            await _answer(send, 404, {"error": f"no peer route {scope['method']} {path}"})
            return
        rid, _, rest = path[len(PREFIX) :].partition("/")
        replica = self.replicas.get(rid)
        if replica is None or replica.node is not None or not replica.ready:
            await _answer(send, 503, {"error": f"replica {rid} is not serving on {self.node}"})
            return
        body = bytearray()
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        headers = [(k, v) for k, v in scope["headers"] if k in (b"content-type", b"x-request-id")]
        headers += replica.key_headers
        relay = asyncio.current_task()
        watcher = asyncio.ensure_future(_watch(receive, relay))
        self.in_flight[rid] = self.in_flight.get(rid, 0) + 1
        try:
            assert self.pool is not None
            try:
                upstream = await self.pool.post(replica.base_url, "/" + rest, headers, bytes(body))
            except UpstreamError as exc:
                await _answer(send, 502, {"error": f"replica {rid} on {self.node}: {exc}"})
                return
            try:
                raw = [(k, v) for k, v in upstream.headers
                       if k in (b"content-type", b"x-request-id")]  # fmt: skip
                await send({"type": "http.response.start", "status": upstream.status_code,
                            "headers": raw})  # fmt: skip
                async for chunk in upstream.iter_raw():
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
                await send({"type": "http.response.body", "body": b"", "more_body": False})
            except UpstreamError:
                await send({"type": "http.response.body", "body": b"", "more_body": False})
            finally:
                await upstream.close()
        except asyncio.CancelledError:
            if relay is not None:
                relay.uncancel()  # the calling node left: the upstream is closed, the worker aborts
        finally:
            watcher.cancel()
            self.in_flight[rid] -= 1


async def _watch(receive: Receive, relay: asyncio.Task[Any] | None) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass
    if relay is not None:
        relay.cancel()


async def _answer(send: Send, status: int, body: dict[str, Any]) -> None:
    payload = json.dumps(body).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(payload)).encode())]})  # fmt: skip
    await send({"type": "http.response.body", "body": payload})


class PeerServer:
    """The peer port's uvicorn, in a thread of its own."""

    def __init__(self, app: PeerApp, sock: socket.socket, context: ssl.SSLContext | None) -> None:
        config = uvicorn.Config(app, log_level="warning", lifespan="on", proxy_headers=False)
        if context is not None:  # uvicorn builds its context from files: hand it ours instead
            config.load()
            config.ssl = context
        self.server = uvicorn.Server(config)
        self.sock = sock
        self.thread = threading.Thread(target=self._run, name="kunlun-peer", daemon=True)

    def _run(self) -> None:
        self.server.run(sockets=[self.sock])

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)
