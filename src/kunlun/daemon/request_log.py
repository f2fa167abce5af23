"""The daemon's request log: one JSON line per finished ``/v1`` request.

``KUNLUN_HOME/logs/requests.jsonl`` gets ``{ts, request_id, method, path, model, status,
latency_ms}`` when a request's response has been sent (or the request ended without one,
``status`` null). ``request_id`` is the one the response carried (``X-Request-Id``: the
client's own, or the one the gateway made up); ``model`` is what the gateway read from the
body (it leaves it in the request's ASGI state). This is how an operator, or a test, sees
exactly which requests arrived: e.g. that a resumed batch did not send a finished id again.

The middleware is plain ASGI, so streamed responses pass through untouched; the log is
line-buffered (one ``write`` per request, no fsync).
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import IO, Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

PREFIX = "/v1/"


class RequestLog:
    """The append-only file; opened on the first entry."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._file: IO[str] | None = None

    def write(self, entry: dict[str, Any]) -> None:
        if self._file is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._file = self.path.open("a", encoding="utf-8", buffering=1)
        self._file.write(json.dumps(entry, ensure_ascii=False) + "\n")

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


class RequestLogMiddleware:
    """Wraps an ASGI app; logs every HTTP request whose path starts with ``/v1/``."""

    def __init__(self, app: ASGIApp, log: RequestLog) -> None:
        self.app = app
        self.log = log

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not scope["path"].startswith(PREFIX):
            await self.app(scope, receive, send)
            return
        started = time.monotonic()
        status: int | None = None
        request_id = _header(scope.get("headers", ()), b"x-request-id")

        async def logged_send(message: Message) -> None:
            nonlocal status, request_id
            if message["type"] == "http.response.start":
                status = message["status"]
                request_id = _header(message.get("headers", ()), b"x-request-id") or request_id
            await send(message)

        try:
            await self.app(scope, receive, logged_send)
        finally:
            self.log.write(
                {
                    "ts": round(time.time(), 3),
                    "request_id": request_id,
                    "method": scope["method"],
                    "path": scope["path"],
                    "model": (scope.get("state") or {}).get("model"),
                    "status": status,
                    "latency_ms": round((time.monotonic() - started) * 1000, 2),
                }
            )


def _header(headers: Any, name: bytes) -> str | None:
    for key, value in headers:
        if key.lower() == name:
            return bytes(value).decode("latin-1")
    return None
