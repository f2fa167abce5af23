"""vLLM's small routes at the daemon, for the clients and probes written against vLLM:
``GET /version``, ``/ping`` (GET and POST: the health answer), ``GET /load`` and
``GET /tokenizer_info`` (a ready replica's tokenizer: its special tokens and chat template, for
lm-eval's remote tokenizer, which then needs no tokenizer files or transformers; the model is
``?model=`` or the only generation model served).

``/tokenize`` and ``/detokenize`` are the gateway's (:mod:`kunlun.serving.gateway`), the
request fields vLLM adds to the OpenAI ones are :class:`~kunlun.protocol.openai_api`'s, and the
``vllm:`` metric names are aliases the telemetry registers (:mod:`kunlun.telemetry`).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response

import kunlun
from kunlun.errors import KunlunError
from kunlun.serving.replica import ReplicaSet
from kunlun.serving.replica_calls import error_response, relayed, replica_answer


def add_vllm_routes(
    router: APIRouter,
    replicas: ReplicaSet,
    state: Any,
    health: Callable[[], Awaitable[Response]],
) -> None:
    """vLLM's routes on the daemon's router; ``health`` answers ``/ping``."""

    @router.get("/version")
    async def version() -> dict[str, str]:
        """The platform's version (vLLM answers its own)."""
        return {"version": kunlun.__version__}

    router.get("/ping")(health)
    router.post("/ping", include_in_schema=False)(health)

    @router.get("/load")
    async def load() -> dict[str, int]:
        """Requests in flight on every replica (vLLM's ``server_load``)."""
        return {"server_load": sum(r.in_flight for r in replicas.all())}

    @router.get("/tokenizer_info")
    async def tokenizer_info(request: Request) -> Response:
        try:
            return relayed(await replica_answer(request, replicas, state, "/tokenizer_info"))
        except KunlunError as exc:
            return error_response(exc)
