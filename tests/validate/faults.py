"""Deliberately broken OpenAI-style endpoints: a real HTTP proxy in front of a real daemon.

One FastAPI app serves every fault under its own path prefix: the endpoint
``http://127.0.0.1:PORT/<fault>`` answers ``/v1/models``, ``/v1/chat/completions`` and
``/v1/completions`` by forwarding to the daemon and breaking the exchange in one way:

- ``bad_sse``: stream events separated by one newline instead of a blank line, no ``[DONE]``;
- ``wrong_usage``: ``completion_tokens`` counts words, not tokens (total kept consistent);
- ``flaky_500``: 500 whenever more than four requests are in flight;
- ``garbage``: every generated character turned into ``!``;
- ``drop_history``: chat requests keep only their last message;
- ``truncate``: every prompt and message cut to its last 1,000 characters;
- ``drop_tools``: ``tools`` and ``tool_choice`` taken out of every request;
- ``healthy``: forwarded untouched (the control).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

FAULTS = (
    "bad_sse",
    "wrong_usage",
    "flaky_500",
    "garbage",
    "drop_history",
    "truncate",
    "drop_tools",
    "healthy",
)
MAX_IN_FLIGHT = 4
KEEP_CHARS = 1000


def faulty_app(upstream: str) -> FastAPI:
    app = FastAPI()
    client = httpx.AsyncClient(base_url=upstream, timeout=300)
    in_flight = {"n": 0}

    @app.get("/{fault}/v1/models")
    async def models(fault: str) -> Response:
        resp = await client.get("/v1/models")
        return Response(resp.content, resp.status_code, media_type="application/json")

    async def forward(fault: str, path: str, request: Request) -> Response:
        body = await request.json()
        if fault == "flaky_500" and in_flight["n"] >= MAX_IN_FLIGHT:
            error = {"message": "overloaded", "type": "server_error", "param": None, "code": None}
            return JSONResponse({"error": error}, status_code=500)
        _break_request(fault, body)
        in_flight["n"] += 1
        if body.get("stream"):
            return StreamingResponse(
                _stream(fault, client, path, body, in_flight), media_type="text/event-stream"
            )
        try:
            resp = await client.post(path, json=body)
        finally:
            in_flight["n"] -= 1
        if resp.status_code != 200:
            return Response(resp.content, resp.status_code, media_type="application/json")
        data = resp.json()
        _break_answer(fault, data, [c.get("message", c) for c in data.get("choices", [])])
        return JSONResponse(data)

    @app.post("/{fault}/v1/chat/completions")
    async def chat(fault: str, request: Request) -> Response:
        return await forward(fault, "/v1/chat/completions", request)

    @app.post("/{fault}/v1/completions")
    async def completions(fault: str, request: Request) -> Response:
        return await forward(fault, "/v1/completions", request)

    return app


def _break_request(fault: str, body: dict[str, Any]) -> None:
    messages = body.get("messages")
    if fault == "drop_history" and isinstance(messages, list):
        body["messages"] = messages[-1:]
    if fault == "drop_tools":
        body.pop("tools", None)
        body.pop("tool_choice", None)
    if fault == "truncate":
        for message in messages or []:
            if isinstance(message.get("content"), str):
                message["content"] = message["content"][-KEEP_CHARS:]
        if isinstance(body.get("prompt"), str):
            body["prompt"] = body["prompt"][-KEEP_CHARS:]


def _break_answer(
    fault: str, data: dict[str, Any], parts: list[dict[str, Any]], streamed: str | None = None
) -> None:
    """Break a whole answer or one chunk; ``parts`` hold its texts (message, delta, choice);
    ``streamed`` is the text a stream carried so far."""
    if fault == "garbage":
        for part in parts:
            for key in ("content", "text"):
                if isinstance(part.get(key), str):
                    part[key] = "!" * len(part[key])
    if fault == "wrong_usage" and isinstance(data.get("usage"), dict):
        if streamed is None:
            streamed = " ".join(str(p.get("content") or p.get("text") or "") for p in parts)
        usage = data["usage"]
        usage["completion_tokens"] = len(streamed.split())
        usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]


async def _stream(
    fault: str,
    client: httpx.AsyncClient,
    path: str,
    body: dict[str, Any],
    in_flight: dict[str, int],
) -> AsyncIterator[bytes]:
    texts: list[str] = []
    try:
        async with client.stream("POST", path, json=body) as resp:
            buffer = b""
            async for piece in resp.aiter_bytes():
                buffer += piece
                *events, buffer = buffer.split(b"\n\n")
                for event in events:
                    out = _break_event(fault, event.decode().removeprefix("data: "), texts)
                    if out is not None:
                        yield out
    finally:
        in_flight["n"] -= 1


def _break_event(fault: str, data: str, texts: list[str]) -> bytes | None:
    if data == "[DONE]":
        return None if fault == "bad_sse" else b"data: [DONE]\n\n"
    chunk = json.loads(data)
    parts = [c.get("delta", c) for c in chunk.get("choices", [])]
    texts.extend(str(p.get("content") or p.get("text") or "") for p in parts)
    _break_answer(fault, chunk, parts, "".join(texts))
    end = b"\n" if fault == "bad_sse" else b"\n\n"
    return b"data: " + json.dumps(chunk).encode() + end
