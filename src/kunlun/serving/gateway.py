"""The OpenAI-compatible gateway: admits each request, picks a replica and proxies to it.

:func:`mount_gateway` adds to an app ``GET /v1/models``, ``POST /v1/chat/completions`` and
``POST /v1/completions`` and ``POST /v1/embeddings`` over a :class:`ReplicaSet` (the inference routes answered by
the :class:`GatewayEndpoints` middleware, ahead of the app's routing). For each request it
reads the ``model`` (and, for the load estimate, ``max_tokens`` and ``n``), the
``X-Kunlun-Priority`` and ``X-Kunlun-Pool`` headers (:mod:`~kunlun.serving.intake`), and
either refuses it in the OpenAI error shape (400: a body nested too deep or holding text UTF-8 cannot hold
(:func:`kunlun.json_text.loads`), more sequences than
:attr:`GatewayState.max_sequences_per_request`, a bad priority or pool header; unknown model or pool
404 listing the served ones, nothing ready or draining 503, a body over
:data:`MAX_BODY_BYTES` 413) or answers with a
:class:`~kunlun.serving.relay.Relay`, which admits it to a replica with a free slot or holds
it in the gateway's fair queue (:mod:`~kunlun.serving.admission`, replica choice by
:mod:`~kunlun.serving.routing`; a full class queue is 429 with ``Retry-After``) and relays
the worker's answer (SGLang's ``/generate`` too: :mod:`~kunlun.serving.sglang_gateway`).
Each request holds one unit of its replica's ``in_flight`` while its
exchange with the worker runs, released whatever the ending.
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.types import ASGIApp, Receive, Scope, Send

from kunlun.errors import KunlunError, Location, RequestError
from kunlun.headers import PREVIOUS_RESPONSE, raw
from kunlun.http_client import UpstreamError
from kunlun.protocol.embedding_request import EmbeddingRequest
from kunlun.protocol.openai_api import ChatCompletionRequest, CompletionRequest
from kunlun.protocol.openai_errors import (
    BodyTooLarge,
    ModelNotFound,
    RouteNotFound,
    ServiceUnavailable,
    WorkerDied,
)
from kunlun.protocol.request_body import openapi_body
from kunlun.serving.admission import Admission
from kunlun.serving.gateway_state import GatewayState
from kunlun.serving.intake import RequestHeaders, new_request_id, ticket
from kunlun.serving.key_limits import KEY_TOKENS_SCOPE
from kunlun.serving.ollama_gateway import OLLAMA_PATHS, add_ollama_routes
from kunlun.serving.queue_metrics import QueueDepth  # telemetry
from kunlun.serving.relay import Relay
from kunlun.serving.replica import ReplicaSet
from kunlun.serving.replica_calls import default_model, error_response, only_model
from kunlun.serving.response_state import RESPONSES_PATH, Recorder
from kunlun.serving.sglang_gateway import GENERATE_PATH, add_sglang_routes
from kunlun.serving.vllm_gateway import add_vllm_routes

_CHAT_BODY = openapi_body(ChatCompletionRequest)
_COMPLETION_BODY = openapi_body(CompletionRequest)
_EMBEDDING_BODY = openapi_body(EmbeddingRequest)
ENDPOINTS = frozenset({"/v1/chat/completions", "/v1/completions", "/v1/embeddings",
                       RESPONSES_PATH, GENERATE_PATH, *OLLAMA_PATHS})  # fmt: skip
"""The inference routes: relayed to a replica."""
MAX_BODY_BYTES = 32 << 20
"""The largest request body the inference routes accept (larger: 413)."""

logger = logging.getLogger(__name__)


def gateway_router(replicas: ReplicaSet, state: GatewayState) -> APIRouter:
    """The ``/v1`` routes, to mount at the root of the daemon's app.

    Mount them with :func:`mount_gateway`, which also puts :class:`GatewayEndpoints` in
    front of the app's routing; these routes then document the endpoints (OpenAPI) and
    answer only where the middleware is absent."""
    router = APIRouter()
    if state.admission is None:  # the daemon mounts the routes twice (API, batch runner)
        state.admission = Admission(replicas, state.router)
        state.metrics.registry.register(QueueDepth(state.admission))  # telemetry

    @router.get("/v1/models")
    async def list_models() -> dict[str, Any]:
        return {"object": "list", "data": replicas.model_cards()}

    @router.get("/v1/models/{model_id:path}")
    async def get_model(model_id: str) -> dict[str, Any]:
        for card in replicas.model_cards():
            if card["id"] == model_id:
                return card
        raise ModelNotFound(f"model {model_id!r} is not served here",
                            location=Location("request", field="model"))  # fmt: skip

    @router.get("/v1/responses/{response_id}")
    async def get_response(response_id: str) -> Response:
        """A kept Responses API answer (:mod:`kunlun.serving.response_state`)."""
        return await _kept(state, "retrieve", response_id)

    @router.delete("/v1/responses/{response_id}")
    async def delete_response(response_id: str) -> Response:
        """Forget a kept Responses API answer."""
        return await _kept(state, "delete", response_id)

    @router.post("/tokenize")
    async def tokenize(request: Request) -> Response:
        """vLLM's ``/tokenize``: ``{model, prompt | messages}`` -> ``{count, max_model_len,
        tokens}``, encoded by the model's own worker."""
        return await _to_a_worker(request, "/tokenize", replicas, state)

    @router.post("/detokenize")
    async def detokenize(request: Request) -> Response:
        """vLLM's ``/detokenize``: ``{model, tokens}`` -> ``{prompt}``."""
        return await _to_a_worker(request, "/detokenize", replicas, state)

    add_sglang_routes(router, replicas, state, respond)  # SGLang's native API

    @router.get("/health")
    async def health() -> Response:
        """200 once a replica is ready (and the gateway is not draining), else 503."""
        if state.draining:
            return JSONResponse({"status": "draining"}, status_code=503)
        if replicas.any_ready():
            return JSONResponse({"status": "ok"})
        return JSONResponse({"status": "no replica is ready yet"}, status_code=503)

    add_vllm_routes(router, replicas, state, health)  # vLLM's /version, /ping, /load, ...
    add_ollama_routes(router, replicas, lambda r, p: _to_a_worker(r, p, replicas, state))

    @router.post("/v1/chat/completions", openapi_extra={"requestBody": _CHAT_BODY})
    async def chat_completions(request: Request) -> Response:
        return respond(request.scope, await request.body(), replicas, state)

    @router.post("/v1/completions", openapi_extra={"requestBody": _COMPLETION_BODY})
    async def completions(request: Request) -> Response:
        return respond(request.scope, await request.body(), replicas, state)

    @router.post("/v1/embeddings", openapi_extra={"requestBody": _EMBEDDING_BODY})
    async def embeddings(request: Request) -> Response:
        return respond(request.scope, await request.body(), replicas, state)

    return router


async def _kept(state: GatewayState, action: str, response_id: str) -> Response:
    """``retrieve`` or ``delete`` a kept response; the 404 of an id not kept, or of a gateway
    that keeps none."""
    try:
        if state.responses is None:
            raise RouteNotFound("this gateway keeps no responses")
        call = state.responses.retrieve if action == "retrieve" else state.responses.delete
        return JSONResponse(await call(response_id))
    except KunlunError as exc:
        return error_response(exc)


async def _to_a_worker(
    request: Request, path: str, replicas: ReplicaSet, state: GatewayState
) -> Response:
    """Forward ``POST path`` to a routable replica of the body's ``model`` (the least
    busy) and answer what it answers: for work only the model's worker can do."""
    body = await request.body()
    try:
        payload = json.loads(body)
    except ValueError:
        raise RequestError("the request body is not JSON") from None
    if not isinstance(payload, dict):
        raise RequestError("the request body is not a JSON object")
    model = only_model(payload.get("model"), replicas, default_model(state))  # or the default
    chosen = min(replicas.ready(model), key=lambda r: r.in_flight, default=None)
    if chosen is None:
        if model in replicas.models():
            raise ServiceUnavailable(f"model {model!r} has no ready replica yet",
                                     retry_after_s=state.retry_after_s)  # fmt: skip
        raise ModelNotFound(f"model {model!r} is not served here; served: "
                            f"{', '.join(replicas.models()) or 'none'}",
                            location=Location("request", field="model"))  # fmt: skip
    if state.upstream is None:
        raise ServiceUnavailable("the gateway is not started", retry_after_s=state.retry_after_s)
    try:
        answer = await state.upstream.post(chosen.base_url, path,
                                           [(b"content-type", b"application/json"),
                                            *chosen.key_headers], body)  # fmt: skip
        try:
            content = b"".join([piece async for piece in answer.iter_raw()])
        finally:
            await answer.close()
    except UpstreamError as exc:
        raise WorkerDied(f"replica {chosen.replica_id} on {chosen.device} did not answer "
                         f"{path}: {exc}", hint="retry the request") from None  # fmt: skip
    return Response(content, status_code=answer.status_code, media_type="application/json")


class GatewayEndpoints:
    """ASGI middleware that serves ``POST /v1/chat/completions``, ``/v1/completions`` and ``/v1/embeddings``
    itself and passes everything else on.

    The inference routes are the gateway's hot path: answered here, ahead of the app's
    exception handling, routing and dependency machinery (the daemon puts this outside its
    FastAPI app altogether, :func:`kunlun.daemon.app.daemon_entry`), they cost the gateway
    about half the CPU per request (``benchmarks/gateway.py``). The body is capped at
    :data:`MAX_BODY_BYTES` (413)."""

    def __init__(self, app: ASGIApp, replicas: ReplicaSet, state: GatewayState) -> None:
        self.app, self.replicas, self.state = app, replicas, state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] not in ENDPOINTS or scope["method"] != "POST":
            await self.app(scope, receive, send)
            return
        pieces, size, more = [], 0, True
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            piece = message.get("body", b"")
            size += len(piece)
            if size > MAX_BODY_BYTES:
                answer: ASGIApp = error_response(BodyTooLarge(
                    f"the request body is over {MAX_BODY_BYTES} bytes",
                    hint="send fewer or shorter messages"))  # fmt: skip
                await answer(scope, receive, send)
                return
            pieces.append(piece)
            more = message.get("more_body", False)
        body = pieces[0] if len(pieces) == 1 else b"".join(pieces)
        previous, recorder = None, None
        if scope["path"] == RESPONSES_PATH and self.state.responses is not None:
            try:
                body, previous, recorder = await self.state.responses.prepare(body)
            except KunlunError as exc:
                await error_response(exc)(scope, receive, send)
                return
        headers = () if previous is None else ((raw(PREVIOUS_RESPONSE), previous.encode()),)
        await respond(scope, body, self.replicas, self.state, headers, recorder)(
            scope, receive, send
        )


def mount_gateway(app: FastAPI, replicas: ReplicaSet, state: GatewayState) -> None:
    """Add the gateway to ``app``: its routes and, in front of them, :class:`GatewayEndpoints`
    (call before adding the middleware that should run first, such as API-key checks)."""
    app.include_router(gateway_router(replicas, state))
    app.add_middleware(GatewayEndpoints, replicas=replicas, state=state)


def respond(
    scope: Scope,
    body: bytes,
    replicas: ReplicaSet,
    state: GatewayState,
    worker_headers: tuple[tuple[bytes, bytes], ...] = (),
    recorder: Recorder | None = None,
) -> Response:
    """The ASGI response to the inference request ``body`` that arrived with ``scope``:
    the relay to a replica (admitted when it runs) or the error that refuses it now."""
    arrived = time.perf_counter()  # telemetry
    headers = RequestHeaders(scope["headers"])
    try:
        admitted = ticket(scope, headers, body, replicas, state)
        charge = scope.get(KEY_TOKENS_SCOPE)  # the key's tokens per minute, when it has a limit
        if charge is not None:
            charge.admit(admitted.tokens)
    except KunlunError as exc:
        model = (scope.get("state") or {}).get("model")
        state.metrics.refused(model, model in replicas.models(), exc)  # telemetry
        return error_response(exc)
    relay = Relay(state, admitted, scope["path"], body, headers.request_id or new_request_id(),
                  worker_headers, recorder)  # fmt: skip
    relay.arrived = arrived  # telemetry
    return relay
