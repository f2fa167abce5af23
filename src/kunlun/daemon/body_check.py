"""The check every JSON body of the daemon's own routes passes before FastAPI parses it.

:class:`JsonBodyCheck` reads the body of a ``POST``, ``PUT`` or ``PATCH`` request sent as
JSON (or with no content type, which FastAPI parses as JSON too) and refuses, with a 400 in the OpenAI error shape, what
:func:`kunlun.json_text.loads` refuses: nesting deeper than
:data:`~kunlun.json_text.MAX_DEPTH` (FastAPI's parser would recurse into a 500) and text
UTF-8 cannot hold (a lone surrogate in an API key's name or a model path would reach the
database or the file system, and 500). A body that passes is handed on unchanged. The
gateway's inference routes check their bodies themselves
(:mod:`kunlun.serving.gateway`); this covers the admin API and the Batch API's JSON routes
in one place instead of per field.
"""

from __future__ import annotations

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kunlun import json_text
from kunlun.errors import RequestError
from kunlun.serving.replica_calls import error_response

_METHODS = frozenset({"POST", "PUT", "PATCH"})


class JsonBodyCheck:
    """ASGI middleware: 400 for a JSON body nested too deep or holding unencodable text."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] not in _METHODS or not _is_json(scope):
            await self.app(scope, receive, send)
            return
        pieces, more = [], True
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            pieces.append(message.get("body", b""))
            more = message.get("more_body", False)
        body = b"".join(pieces)
        if body.strip():
            try:
                json_text.loads(body)
            except RequestError as exc:
                await error_response(exc)(scope, receive, send)
                return
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)


def _is_json(scope: Scope) -> bool:
    """Whether FastAPI would parse the body as JSON: sent as JSON, or with no content type."""
    for name, value in scope.get("headers", ()):
        if name == b"content-type":
            return bytes(value).split(b";", 1)[0].strip().lower().endswith(b"json")
    return True
