"""The pool relay: what a tool sends to it reaches the target with the pool header added."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from tests import loopback
from tests.serving.conftest import serve_in_thread

from kunlun.validate.client import TargetClient
from kunlun.validate.matrix import Column
from kunlun.validate.relay import PoolRelay


def test_relay_adds_pool_and_key_and_passes_the_answer_back() -> None:
    seen: dict[str, Any] = {}
    app = FastAPI()

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> JSONResponse:
        seen.update(headers=dict(request.headers), body=await request.json())
        return JSONResponse({"answer": "ok"}, headers={"X-Kunlun-Device": "ascend:3"})

    server, url, thread = serve_in_thread(app)
    client = TargetClient(Column("ascend", url, "m", pool="ascend"), api_key="secret")
    try:
        with PoolRelay(client) as relay_url:
            resp = loopback.post(relay_url + "/v1/chat/completions", json={"model": "m"},
                              headers={"X-Request-Id": "job:1:1"}, timeout=30)  # fmt: skip
    finally:
        client.close()
        server.should_exit = True  # type: ignore[attr-defined]
        thread.join(10)
    assert resp.status_code == 200 and resp.json() == {"answer": "ok"}
    assert resp.headers["x-kunlun-device"] == "ascend:3"
    assert seen["body"] == {"model": "m"}
    headers = seen["headers"]
    assert headers["x-kunlun-pool"] == "ascend"
    assert headers["authorization"] == "Bearer secret"
    assert headers["x-request-id"] == "job:1:1"
    assert client.devices == {"ascend:3": 1}  # counted for the routing row
