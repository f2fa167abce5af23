"""SGLang's native API at the daemon: ``/generate`` relayed, the info and flush routes
answered from the replicas.

``POST /generate`` goes through the same admission, routing, streaming relay and telemetry as
the OpenAI routes (:func:`~kunlun.serving.gateway.respond`); :func:`admission_view` gives the
gateway what it reads of an OpenAI body (``model``, prompts x ``n``, ``max_tokens``) from an
SGLang body, which is forwarded unchanged. SGLang serves one model, so a body without
``model`` (Kunlun's extension) goes to the configured default or the only generation model
served (:func:`~kunlun.serving.replica_calls.only_model`).

``GET /get_model_info`` and ``GET /get_server_info`` are answered by a ready replica of the
model (chosen with the query parameter ``?model=``, or the only one served);
``/get_server_info`` adds ``served_models`` and ``num_replicas``. ``/flush_cache`` flushes
every ready replica of the model: ``Cache flushed.`` once all did, else a 400 naming the
replicas that refused (each refuses while it runs requests).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response

from kunlun.errors import KunlunError, RequestError
from kunlun.protocol.openai_errors import (
    param_error,
)
from kunlun.protocol.sglang import DEFAULT_MAX_NEW_TOKENS
from kunlun.serving.replica import ReplicaSet
from kunlun.serving.replica_calls import (
    ask_replica,
    error_response,
    only_model,
    ready_replicas,
    relayed,
    replica_answer,
)
from kunlun.serving.sglang_api import FLUSHED

GENERATE_PATH = "/generate"


def admission_view(
    payload: Any, replicas: ReplicaSet, limit: int, default: str | None = None
) -> dict[str, Any]:
    """An SGLang ``/generate`` body as the gateway's admission reads an OpenAI one: its
    model, and ``max_tokens`` standing for every sequence's tokens; a body asking for more
    than ``limit`` sequences (prompts x ``sampling_params.n``) is a 400 here."""
    if not isinstance(payload, dict):
        raise RequestError("the request body is not a JSON object")
    model = only_model(payload.get("model"), replicas, default)
    params = payload.get("sampling_params")
    params = params if isinstance(params, dict) else {}
    n = params.get("n")
    n = n if isinstance(n, int) and not isinstance(n, bool) and n >= 1 else 1
    text, ids = payload.get("text"), payload.get("input_ids")
    num_prompts = 1
    if isinstance(text, list):
        num_prompts = len(text)
    elif isinstance(ids, list) and ids and isinstance(ids[0], list):
        num_prompts = len(ids)
    if num_prompts * n > limit:
        raise param_error(
            "sampling_params.n" if n > 1 else "text" if text is not None else "input_ids",
            f"the request asks for {num_prompts * n} sequences ({num_prompts} prompt(s) x "
            f"n={n}); at most {limit} are run per request (--max-sequences-per-request)",
        )
    max_new = params.get("max_new_tokens", DEFAULT_MAX_NEW_TOKENS)
    view: dict[str, Any] = {"model": model}
    if isinstance(max_new, int) and not isinstance(max_new, bool):
        view["max_tokens"] = max(max_new, 1) * n * num_prompts
    return view


def add_sglang_routes(
    router: APIRouter, replicas: ReplicaSet, state: Any, respond: Callable[..., Response]
) -> None:
    """SGLang's native routes on the daemon's router; ``respond`` relays an inference body."""

    @router.post(GENERATE_PATH)
    async def generate(request: Request) -> Response:
        """SGLang's ``/generate`` (answered by the gateway middleware where it runs)."""
        return respond(request.scope, await request.body(), replicas, state)

    async def info(request: Request, path: str) -> Response:
        try:
            status, body, chosen = await replica_answer(request, replicas, state, path)
        except KunlunError as exc:
            return error_response(exc)
        if status != 200:
            return relayed((status, body, chosen))
        answer = json.loads(body)
        if path == "/get_server_info":
            answer["served_models"] = replicas.models()
            answer["num_replicas"] = len(chosen)
        return JSONResponse(answer)

    @router.get("/get_model_info")
    async def get_model_info(request: Request) -> Response:
        """SGLang's model info of the model (``?model=``, or the only one served)."""
        return await info(request, "/get_model_info")

    @router.get("/get_server_info")
    async def get_server_info(request: Request) -> Response:
        """What the model's engine runs with, plus the served models."""
        return await info(request, "/get_server_info")

    @router.post("/flush_cache")
    async def flush_cache(request: Request) -> Response:
        """Flush the prefix cache of every ready replica of the model."""
        try:
            model, chosen = ready_replicas(request, replicas, state)
        except KunlunError as exc:
            return error_response(exc)
        refused = []
        for replica in chosen:
            status, body = await ask_replica(state, replica, "/flush_cache")
            if status != 200:
                refused.append(f"{replica.replica_id}: {_message(body)}")
        if refused:
            return error_response(RequestError(f"cache of model {model!r} not flushed on "
                               f"{len(refused)} of {len(chosen)} replicas ({'; '.join(refused)})",
                               hint="retry when the replicas are idle"))  # fmt: skip
        return PlainTextResponse(FLUSHED)

    router.get("/flush_cache", include_in_schema=False)(flush_cache)  # SGLang answers GET too

    @router.get("/health_generate")
    async def health_generate(request: Request) -> Response:
        """200 once a replica of the model (``?model=``, or the only generation model) has
        generated a token."""
        try:
            return relayed(await replica_answer(request, replicas, state, "/health_generate"))
        except KunlunError as exc:
            return error_response(exc)


def _message(body: bytes) -> str:
    try:
        return str(json.loads(body)["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return body.decode("utf-8", "replace")[:200]
