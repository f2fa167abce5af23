"""The gateway's intake of one inference request: what it reads of it, once, and the
refusals that answer it at once (:func:`ticket`).

The headers the gateway reads are found in one pass over the ASGI list
(:class:`RequestHeaders`); a client's ``X-Request-Id`` is kept when printable, else the
gateway makes one up (:func:`new_request_id`). The body is read with bounded nesting and
UTF-8-only text (:func:`kunlun.json_text.loads`; SGLang's ``/generate`` body seen as an OpenAI
one, :func:`~kunlun.serving.sglang_gateway.admission_view`), and the request is refused, in
this order: 400 for a body without a model name, more sequences (prompts x ``n``) than
:attr:`~kunlun.serving.gateway_state.GatewayState.max_sequences_per_request` or a bad
``X-Kunlun-Priority``; 503 while draining; 404 for a model nothing serves (listing the served
ones), 503 when none of its replicas is ready or all are out of routing; 404 for a pool
(``X-Kunlun-Pool``) that serves no replica of the model (a malformed one: 400), 503 when none
of them is ready yet.
Otherwise its :class:`~kunlun.serving.admission.Ticket` holds its class (header > API key >
workload), pool, token estimate (load-aware routing) and, during a rollout, the version the
traffic split gives it (sticky per session).
"""

from __future__ import annotations

import itertools
import os
from typing import Any

from starlette.types import Scope

from kunlun import headers as http_headers
from kunlun import json_text
from kunlun.errors import Location
from kunlun.protocol.openai_api import request_sequences
from kunlun.protocol.openai_errors import ModelNotFound, ServiceUnavailable, param_error
from kunlun.serving.admission import Ticket
from kunlun.serving.canary_split import SESSION_HEADER
from kunlun.serving.canary_window import BASELINE
from kunlun.serving.gateway_state import GatewayState
from kunlun.serving.ollama_gateway import EMBEDDING_PATHS, OLLAMA_PATHS, ollama_admission_view
from kunlun.serving.replica import ReplicaSet
from kunlun.serving.replica_calls import default_model
from kunlun.serving.routing import (
    KEY_PRIORITY_SCOPE,
    POOL_HEADER,
    PRIORITY_HEADER,
    PoolNotFound,
    pool_header,
    resolve_priority,
)
from kunlun.serving.sglang_gateway import GENERATE_PATH, admission_view

_PRIORITY_KEY = PRIORITY_HEADER.lower().encode()
_REQUEST_ID_KEY = http_headers.raw(http_headers.REQUEST_ID)
_POOL_KEY = POOL_HEADER.lower().encode()
_SESSION_KEY = SESSION_HEADER.lower().encode()
_PRINTABLE = frozenset(range(0x20, 0x7F))
"""Bytes a client's ``X-Request-Id`` may hold to be passed on (printable ASCII)."""
_ID_PREFIX = os.urandom(4).hex()
_ID_COUNTER = itertools.count(1)
DEFAULT_MAX_TOKENS_ESTIMATE = 256
"""Tokens counted for a request that sets no ``max_tokens`` (load-aware routing)."""


class RequestHeaders:
    """The request headers the gateway reads, found in one pass over the ASGI list."""

    __slots__ = ("pool", "priority", "request_id", "session")

    def __init__(self, raw: list[tuple[bytes, bytes]]) -> None:
        self.pool = self.priority = self.request_id = None
        self.session: bytes | None = None
        for name, value in raw:
            if name == _SESSION_KEY:
                self.session = value
            elif name == _PRIORITY_KEY:
                self.priority = value.decode("latin-1")
            elif name == _POOL_KEY:
                self.pool = value.decode("latin-1")
            elif name == _REQUEST_ID_KEY and value and _PRINTABLE.issuperset(value):
                self.request_id = value.decode("ascii")  # else the gateway makes one up


def new_request_id() -> str:
    """A request id unique to this process (random prefix, counter): cheaper than uuid4."""
    return f"{_ID_PREFIX}{next(_ID_COUNTER):08x}"


def ticket(
    scope: Scope, headers: RequestHeaders, body: bytes, replicas: ReplicaSet, state: GatewayState
) -> Ticket:
    """What admission needs to know of a request, or the error that refuses it at once."""
    payload = json_text.loads(body)  # bounded nesting, UTF-8 text (else 400)
    if scope["path"] == GENERATE_PATH:  # SGLang's body, seen as an OpenAI one
        payload = admission_view(payload, replicas, state.max_sequences_per_request,
                                 default_model(state))  # fmt: skip
    elif scope["path"] in OLLAMA_PATHS:  # and Ollama's
        payload = ollama_admission_view(payload)
    model = payload.get("model") if isinstance(payload, dict) else None
    if not isinstance(model, str):
        raise param_error("model", "the request has no model name (field 'model')")
    scope.setdefault("state", {})["model"] = model  # for the request log and the metrics
    _check_sequences(payload, state.max_sequences_per_request)
    if headers.priority is not None:
        resolve_priority(headers.priority, None, "normal")  # a bad value is a 400 first
    if state.draining:
        raise ServiceUnavailable(
            "the platform is shutting down and takes no new requests",
            retry_after_s=state.retry_after_s,
        )
    serving = replicas.serving(model)
    first_ready = next((r for r in serving if r.routable), None)
    if first_ready is None:
        served = replicas.models()
        if model not in served:
            names = ", ".join(served) or "none"
            raise ModelNotFound(f"model {model!r} is not served here; served models: {names}")
        ejected = [f"{r.replica_id}: {r.ejected}" for r in serving if r.ready and r.ejected]
        if ejected:
            raise ServiceUnavailable(
                f"every ready replica of model {model!r} is out of routing after failed "
                f"health checks ({'; '.join(ejected)})",
                retry_after_s=state.retry_after_s,
            )
        raise ServiceUnavailable(
            f"no replica of model {model!r} is ready yet", retry_after_s=state.retry_after_s
        )
    pool = headers.pool
    if pool is not None:
        pool = pool_header(pool)
        if not any(r.routable and pool in r.pools for r in serving):
            _refuse_pool(model, pool, replicas, state)
    priority = resolve_priority(
        headers.priority, scope.get(KEY_PRIORITY_SCOPE), first_ready.priority
    )
    estimate = _token_estimate(payload, len(body), scope["path"] not in EMBEDDING_PATHS)
    ticket = Ticket(model, priority, pool, estimate)
    ticket.streams = payload.get("stream") is True
    split = state.splits.get(model)
    if split is not None:
        version = split.choose(headers.session)
        if not any(r.routable and r.workload_id == version.workload for r in serving):
            version = split.version(version.role == BASELINE)  # the other one, while it serves
        ticket.version, ticket.workload = version, version.workload
    return ticket


def _check_sequences(payload: dict[str, Any], limit: int) -> None:
    """Refuse (400) a request that asks for more than ``limit`` sequences (prompts x n)."""
    num_prompts, n = request_sequences(payload)
    if num_prompts * n > limit:
        raise param_error(
            "n" if n > 1 else "prompt",
            f"the request asks for {num_prompts * n} sequences ({num_prompts} prompt(s) x "
            f"n={n}); at most {limit} are run per request (--max-sequences-per-request)",
        )


def _refuse_pool(model: str, pool: str, replicas: ReplicaSet, state: GatewayState) -> None:
    pools = sorted(frozenset().union(*(r.pools for r in replicas.serving(model))))
    if pool in pools:
        raise ServiceUnavailable(
            f"no replica of model {model!r} in pool {pool!r} is ready yet",
            retry_after_s=state.retry_after_s,
        )
    raise PoolNotFound(
        f"model {model!r} has no replica in pool {pool!r} (header {POOL_HEADER}); "
        f"pools serving it: {', '.join(pools)}",
        location=Location("request", field=POOL_HEADER),
    )


def _token_estimate(payload: dict[str, Any], body_bytes: int, generates: bool = True) -> int:
    """Prompt tokens (about four body bytes each) plus ``max_tokens`` for each of ``n`` (none
    for an embeddings request: it generates nothing)."""
    if not generates:
        return body_bytes // 4
    max_tokens = (
        payload.get("max_tokens")
        or payload.get("max_completion_tokens")
        or payload.get("max_output_tokens")
    )  # (the Responses API's)
    n = payload.get("n")
    if not isinstance(max_tokens, int) or max_tokens < 1:
        max_tokens = DEFAULT_MAX_TOKENS_ESTIMATE
    if not isinstance(n, int) or n < 1:
        n = 1
    return body_bytes // 4 + max_tokens * n
