"""The OpenAI-compatible gateway: picks a replica for each request and proxies to it.

:func:`gateway_router` serves ``GET /v1/models``, ``POST /v1/chat/completions`` and
``POST /v1/completions`` over a :class:`ReplicaSet`. For each request it reads only the
``model`` field, picks a ready replica (:func:`choose_replica`) and relays the worker's
answer byte for byte (status, body, ``X-Request-Id``), adding ``X-Kunlun-Replica`` and
``X-Kunlun-Device``. Refusals use the OpenAI error shape: unknown model 404 (listing the
served ones), nothing ready or draining 503, every queue full 429 with ``Retry-After``.

A worker that dies mid-stream ends the client's stream with one SSE error event (code
``worker_died``) and no ``[DONE]``; one that dies before answering gives 502. A client that
disconnects closes the upstream response at once, which makes the worker abort the
generation. Each request holds one unit of its replica's ``in_flight`` while its exchange
with the worker runs, released whatever the ending.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from starlette.types import Receive, Scope, Send

from kunlun.errors import KunlunError, RequestError
from kunlun.serving import sse
from kunlun.serving.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    ModelNotFound,
    QueueFull,
    ServiceUnavailable,
    WorkerDied,
    error_status_and_body,
    openapi_body,
    param_error,
)
from kunlun.serving.replica import Replica, ReplicaSet
from kunlun.serving.upstream import (
    UpstreamBroken,
    UpstreamError,
    UpstreamPool,
    UpstreamResponse,
    UpstreamUnreachable,
)
from kunlun.telemetry.gateway_metrics import CLIENT_GONE, GatewayMetrics  # telemetry

_FORWARDED = (b"content-type", b"content-length", b"x-request-id", b"cache-control")
"""Upstream response headers passed to the client."""
_SSE = sse.MEDIA_TYPE.encode()
_CHAT_BODY = openapi_body(ChatCompletionRequest)
_COMPLETION_BODY = openapi_body(CompletionRequest)


@dataclass
class GatewayState:
    """What the gateway keeps between requests; the daemon calls :meth:`start` and
    :meth:`close` from its lifespan and sets :attr:`draining` on SIGTERM."""

    draining: bool = False
    """New requests get 503 (in-flight ones finish)."""
    retry_after_s: int = 1
    """``Retry-After`` sent with 429 and 503 answers."""
    connect_timeout_s: float = 5.0
    """How long to wait for a worker to accept a connection."""
    num_active: int = 0
    """Requests admitted and not yet answered, over all replicas (for draining)."""
    upstream: UpstreamPool | None = field(default=None, repr=False)
    """Shared keep-alive connections to the workers (made by :meth:`start`)."""
    metrics: GatewayMetrics = field(default_factory=GatewayMetrics, repr=False)  # telemetry
    """Request counters and latency histograms (part of the daemon's ``/metrics``)."""

    async def start(self) -> None:
        """Open the connection pool (call from the app's lifespan, in its event loop)."""
        if self.upstream is None:
            self.upstream = UpstreamPool(connect_timeout_s=self.connect_timeout_s)

    async def close(self) -> None:
        """Close every pooled connection."""
        upstream, self.upstream = self.upstream, None
        if upstream is not None:
            await upstream.close()


_ties = itertools.count()


def choose_replica(candidates: list[Replica]) -> Replica:
    """The replica with the fewest requests in flight; ties take turns (round-robin).
    ``candidates`` is non-empty and holds only replicas with room in their queue."""
    least = min(r.in_flight for r in candidates)
    tied = [r for r in candidates if r.in_flight == least]
    return tied[next(_ties) % len(tied)] if len(tied) > 1 else tied[0]


def gateway_router(replicas: ReplicaSet, state: GatewayState) -> APIRouter:
    """The ``/v1`` routes, to mount at the root of the daemon's app."""
    router = APIRouter()

    @router.get("/v1/models")
    async def list_models() -> dict[str, Any]:
        data = [{"id": m, "object": "model", "created": 0, "owned_by": "kunlun"}
                for m in replicas.models()]  # fmt: skip
        return {"object": "list", "data": data}

    @router.post("/v1/chat/completions", openapi_extra={"requestBody": _CHAT_BODY})
    async def chat_completions(request: Request) -> Response:
        return await _proxy(request, "/v1/chat/completions", replicas, state)

    @router.post("/v1/completions", openapi_extra={"requestBody": _COMPLETION_BODY})
    async def completions(request: Request) -> Response:
        return await _proxy(request, "/v1/completions", replicas, state)

    return router


def error_response(exc: BaseException) -> Response:
    """The gateway's answer to ``exc``, in the OpenAI error shape."""
    status, body, headers = error_status_and_body(exc)
    return JSONResponse(body, status_code=status, headers=headers)


async def _proxy(
    request: Request, path: str, replicas: ReplicaSet, state: GatewayState
) -> Response:
    arrived = time.perf_counter()  # telemetry
    body = await request.body()
    model = None
    try:
        model = _model_of(body)
        replica = _admit(model, replicas, state)
    except KunlunError as exc:
        state.metrics.refused(model, model in replicas.models(), exc)  # telemetry
        return error_response(exc)
    request_id = request.headers.get("x-request-id") or uuid.uuid4().hex
    upstream = _Upstream(state, replica, path, body, request_id)  # counted in flight while it runs
    upstream.arrived = arrived  # telemetry
    return upstream


def _model_of(body: bytes) -> str:
    try:
        payload = json.loads(body)
    except ValueError as exc:
        raise RequestError(f"request body is not valid JSON: {exc}") from None
    model = payload.get("model") if isinstance(payload, dict) else None
    if not isinstance(model, str):
        raise param_error("model", "the request has no model name (field 'model')")
    return model


def _admit(model: str, replicas: ReplicaSet, state: GatewayState) -> Replica:
    """The replica that takes a request for ``model``, or the error that refuses it."""
    if state.draining:
        raise ServiceUnavailable(
            "the platform is shutting down and takes no new requests",
            retry_after_s=state.retry_after_s,
        )
    candidates = replicas.ready(model)
    if not candidates:
        served = replicas.models()
        if model not in served:
            names = ", ".join(served) or "none"
            raise ModelNotFound(f"model {model!r} is not served here; served models: {names}")
        raise ServiceUnavailable(
            f"no replica of model {model!r} is ready yet", retry_after_s=state.retry_after_s
        )
    open_ = [r for r in candidates if r.in_flight < r.max_queue]
    if not open_:
        raise QueueFull(
            f"every replica of model {model!r} has its queue full "
            f"({sum(r.in_flight for r in candidates)} requests in flight)",
            retry_after_s=state.retry_after_s,
        )
    return choose_replica(open_)


class _Upstream(Response):
    """The response to one admitted request: sends it to the replica and relays the answer.

    Its ``__call__`` holds one unit of the replica's ``in_flight`` from its first line to its
    ``finally``, so the unit is taken and released exactly once however the exchange ends. A task watches for the client disconnecting and
    cancels the relay, which closes the upstream connection (the worker then aborts)."""

    def __init__(
        self, state: GatewayState, replica: Replica, path: str, body: bytes, request_id: str
    ) -> None:
        self.state, self.replica = state, replica
        self.path, self.payload, self.request_id = path, body, request_id
        self.status_code, self.raw_headers, self.background = 200, [], None
        self._ended = False
        self.arrived = time.perf_counter()  # telemetry: perf_counter readings
        self.dispatched: float | None = None  # telemetry

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        self.replica.in_flight += 1
        self.state.num_active += 1
        relay = asyncio.current_task()
        watcher = asyncio.ensure_future(self._watch(receive, relay))
        try:
            await self._exchange(send)
        except asyncio.CancelledError:
            if not watcher.done() or watcher.cancelled():
                raise  # cancelled from elsewhere
            if relay is not None:
                relay.uncancel()  # the client left: nothing to answer
            self.status_code = CLIENT_GONE  # telemetry
        finally:
            self._ended = True
            watcher.cancel()
            self.replica.in_flight -= 1
            self.state.num_active -= 1
            r = self.replica  # telemetry: a few counter increments, no body parsing
            self.state.metrics.finished(r.model, r.replica_id, r.priority, self.status_code,
                                        self.arrived, self.dispatched)  # fmt: skip

    async def _watch(self, receive: Receive, relay: asyncio.Task[Any] | None) -> None:
        while (await receive())["type"] != "http.disconnect":
            pass
        if not self._ended and relay is not None:
            relay.cancel()

    async def _exchange(self, send: Send) -> None:
        pool = self.state.upstream
        if pool is None:
            raise RuntimeError("GatewayState.start() was not called")
        headers = [(b"content-type", b"application/json"),
                   (b"x-request-id", self.request_id.encode())]  # fmt: skip
        self.dispatched = time.perf_counter()  # telemetry: end of the gateway queue time
        try:
            upstream = await pool.post(self.replica.base_url, self.path, headers, self.payload)
        except UpstreamError as exc:
            await self._send_error(send, self._unreachable(exc))
            return
        try:
            await self._relay(upstream, send)
        finally:
            await upstream.close()

    async def _relay(self, upstream: UpstreamResponse, send: Send) -> None:
        raw = [(k, v) for k, v in upstream.headers if k in _FORWARDED]
        raw += [(b"x-kunlun-replica", self.replica.replica_id.encode()),
                (b"x-kunlun-device", self.replica.device.encode())]  # fmt: skip
        self.status_code = upstream.status_code  # telemetry
        await send({"type": "http.response.start", "status": upstream.status_code, "headers": raw})
        last = b"\n\n"
        try:
            async for chunk in upstream.iter_raw():
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
                last = chunk
        except UpstreamBroken as exc:
            self.status_code = WorkerDied.http_status  # telemetry
            if (upstream.header(b"content-type") or b"").startswith(_SSE):
                separator = b"" if last.endswith(b"\n\n") else b"\n\n"
                event = separator + sse.error_event(self._died(exc))
                await send({"type": "http.response.body", "body": event, "more_body": True})
        self._ended = True
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def _send_error(self, send: Send, exc: KunlunError) -> None:
        status, body, extra = error_status_and_body(exc)
        payload = sse.dumps(body)
        headers = [(b"content-type", b"application/json"),
                   (b"content-length", str(len(payload)).encode()),
                   (b"x-request-id", self.request_id.encode()),
                   (b"x-kunlun-replica", self.replica.replica_id.encode())]  # fmt: skip
        headers += [(k.lower().encode(), v.encode()) for k, v in extra.items()]
        self.status_code = status  # telemetry
        await send({"type": "http.response.start", "status": status, "headers": headers})
        self._ended = True
        await send({"type": "http.response.body", "body": payload, "more_body": False})

    def _died(self, exc: Exception) -> WorkerDied:
        return WorkerDied(
            f"the engine worker serving this request stopped before finishing it "
            f"(replica {self.replica.replica_id} on {self.replica.device}: "
            f"{type(exc).__name__}: {exc})",
            hint="retry the request; the platform restarts the worker",
        )

    def _unreachable(self, exc: Exception) -> KunlunError:
        if isinstance(exc, UpstreamUnreachable):
            return ServiceUnavailable(
                f"the engine worker of replica {self.replica.replica_id} on "
                f"{self.replica.device} is not reachable ({type(exc).__name__}: {exc})",
                retry_after_s=self.state.retry_after_s,
            )
        return self._died(exc)
