"""Request-as-a-Service endpoints in the daemon: the admin routes that make them and the
``/v1`` routes that call and describe them (:mod:`kunlun.serving.endpoints`).

Admin (``admin`` keys): ``GET /api/v1/endpoints``, ``POST /api/v1/endpoints`` (a definition;
``?replace=true`` to replace one of the same name, else 409), ``GET`` and ``DELETE
/api/v1/endpoints/{name}``. Inference keys: ``GET /v1/endpoints`` (name, model, description,
created, url, openapi), ``GET /v1/endpoints/{name}/openapi.json`` and ``POST
/v1/endpoints/{name}`` (the body is the input; ``max_tokens``, ``temperature`` and ``seed`` as
query parameters).

A call's chat completion goes through the gateway *in-process*: the request's own ASGI scope,
with the path of ``/v1/chat/completions`` and the new body, is handed to
:func:`kunlun.serving.gateway.respond`, and the answer collected. It is thus admitted, queued,
routed and relayed exactly as a client's chat request, under the caller's key (its priority,
and its tokens-per-minute charge, settled from this reply's ``usage``), with the caller's
``X-Kunlun-Priority``/``X-Kunlun-Pool``/``X-Request-Id`` headers, counted in the gateway's
metrics as a chat completion and logged under the endpoint's path; no socket, no second key
check. A refusal (429, 503, 404 for a model not served) is passed on as the gateway gave it.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import TYPE_CHECKING, Any

from fastapi import APIRouter, Body, Query, Request
from fastapi.responses import JSONResponse, Response
from starlette.types import Message

from kunlun import budgets, json_text
from kunlun import headers as http_headers
from kunlun.errors import Location, RequestError
from kunlun.serving.endpoints import (
    NAME_RE,
    EndpointExists,
    EndpointNotFound,
    call_params,
    chat_request,
    check_definition,
    check_guided,
    check_input,
    describe,
    openapi_document,
    read_answer,
    render_prompt,
)
from kunlun.serving.gateway import respond
from kunlun.serving.handoff import relayed_only
from kunlun.state.store import EndpointRecord

if TYPE_CHECKING:
    from kunlun.daemon.app import Platform

CHAT_PATH = "/v1/chat/completions"
_PASSED_HEADERS = frozenset({b"retry-after", *map(http_headers.raw, (http_headers.REQUEST_ID,
                             http_headers.REPLICA, http_headers.DEVICE, http_headers.PRIORITY))})  # fmt: skip
"""Headers of the gateway's answer that the endpoint's answer carries too."""


def endpoints_admin_router(platform: Platform) -> APIRouter:
    """The admin routes, to mount under ``/api/v1``."""
    router = APIRouter()
    store = platform.store

    @router.get("/endpoints")
    def list_all() -> list[dict[str, Any]]:
        return [vars(r) for r in store.list_endpoints()]

    @router.post("/endpoints")
    async def create(
        body: dict[str, Any] = Body(...), replace: bool = Query(False)
    ) -> dict[str, Any]:
        # schemas are compiled (and their patterns) off the event loop, within the budget
        record = await budgets.bounded("the endpoint's schemas", check_definition, body, None,
                                       time.time())  # fmt: skip
        _check_model(platform, record.model)
        guided = await budgets.bounded("output_schema", check_guided, record.output_schema)
        old = store.get_endpoint(record.name)
        if old is not None:
            if not replace:
                raise EndpointExists(f"endpoint {record.name!r} exists",
                                     location=Location("request", field="name"),
                                     hint="replace it with --replace (?replace=true)")  # fmt: skip
            record.created = old.created
        await asyncio.to_thread(store.put_endpoint, record)
        return {**vars(record), "replaced": old is not None, "output_schema_compiled": guided}

    @router.get("/endpoints/{name}")
    def show(name: str) -> dict[str, Any]:
        return vars(_lookup(platform, name))

    @router.delete("/endpoints/{name}")
    def delete(name: str) -> dict[str, Any]:
        if not NAME_RE.fullmatch(name) or not store.delete_endpoint(name):
            raise _not_found(name)
        return {"name": name, "deleted": True}

    return router


def endpoints_router(platform: Platform) -> APIRouter:
    """The ``/v1/endpoints`` routes, to mount at the root."""
    router = APIRouter()

    @router.get("/v1/endpoints")
    def list_public(request: Request) -> dict[str, Any]:
        base = str(request.base_url)
        return {"object": "list",
                "data": [describe(r, base) for r in platform.store.list_endpoints()]}  # fmt: skip

    @router.get("/v1/endpoints/{name}/openapi.json")
    def openapi(name: str, request: Request) -> dict[str, Any]:
        return openapi_document(_lookup(platform, name), str(request.base_url))

    @router.post("/v1/endpoints/{name}")
    async def call(name: str, request: Request) -> Response:
        record = _lookup(platform, name)
        params = call_params(request.query_params.multi_items())
        raw = await request.body()
        if not raw.strip():
            raise RequestError("the request body (the endpoint's input, as JSON) is empty",
                               location=Location("request", field="input"))  # fmt: skip
        body = json_text.loads(raw)
        await budgets.bounded("input", check_input, record, body)
        prompt = render_prompt(record, body)
        status, headers, content = await _chat(
            platform, request, chat_request(record, prompt, params)
        )
        if status != 200:
            return Response(content, status, headers=headers, media_type="application/json")
        answer = await budgets.bounded("output", read_answer, record, json.loads(content))
        return JSONResponse(answer, headers=headers)

    return router


async def _chat(
    platform: Platform, request: Request, body: bytes
) -> tuple[int, dict[str, str], bytes]:
    """The gateway's answer to the chat completion ``body``, sent as ``request``'s caller
    sent theirs (see the module docstring): status, the passed-on headers, body."""
    scope = dict(request.scope)
    scope.update(path=CHAT_PATH, raw_path=CHAT_PATH.encode(), query_string=b"")
    relayed_only(scope)  # the answer comes back here, reshaped before it goes out
    answer = respond(scope, body, platform.replicas, platform.gateway)
    status, headers, pieces = 500, {}, []

    async def collect(message: Message) -> None:
        nonlocal status
        if message["type"] == "http.response.start":
            status = message["status"]
            for key, value in message.get("headers", ()):
                if key.lower() in _PASSED_HEADERS:
                    headers[key.decode("latin-1")] = value.decode("latin-1")
        elif message["type"] == "http.response.body":
            pieces.append(message.get("body", b""))

    await answer(scope, request.receive, collect)
    return status, headers, b"".join(pieces)


def _lookup(platform: Platform, name: str) -> EndpointRecord:
    record = platform.store.get_endpoint(name) if NAME_RE.fullmatch(name) else None
    if record is None:
        raise _not_found(name)
    return record


def _not_found(name: str) -> EndpointNotFound:
    return EndpointNotFound(f"no endpoint named {name!r}",
                            hint="GET /v1/endpoints lists them")  # fmt: skip


def _check_model(platform: Platform, model: str) -> None:
    """Refuse a model this platform does not know: not served now, not the name of a
    workload, not an imported model's alias."""
    known = set(platform.replicas.models())
    known.update(w.name for w in platform.store.list_workloads())
    known.update(m.alias for m in platform.store.list_models())
    if model not in known:
        raise RequestError(f"model: {model!r} is not a model of this platform; known: "
                           f"{', '.join(sorted(known)) or 'none'}",
                           location=Location("request", field="model"),
                           hint="name a served model (GET /v1/models) or an imported alias "
                           "(kunlun-cli model list)")  # fmt: skip
