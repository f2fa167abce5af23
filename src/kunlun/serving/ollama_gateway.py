"""Ollama's API at the daemon: ``POST /api/chat``, ``/api/generate``, ``/api/embed`` and
``/api/embeddings`` go through the same admission, keys, routing, relay and telemetry as the
OpenAI routes (:data:`OLLAMA_PATHS`, answered by the workers:
:mod:`kunlun.serving.ollama_api`); ``GET /api/tags``, ``/api/ps`` and ``/api/version`` are
answered from the replicas, and ``POST /api/show`` by a replica of the model named.
"""

from __future__ import annotations

import hashlib
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response

import kunlun
from kunlun.protocol.ollama import created_at, details
from kunlun.serving.external import EMBEDDINGS_PATH
from kunlun.serving.replica import ReplicaSet

OLLAMA_PATHS = frozenset({"/api/chat", "/api/generate", "/api/embed", "/api/embeddings"})
"""Ollama's inference routes: admitted and relayed as the OpenAI ones are."""
EMBEDDING_PATHS = frozenset({EMBEDDINGS_PATH, "/api/embed", "/api/embeddings"})
"""The inference routes that generate nothing (their estimate is their input alone)."""


def ollama_admission_view(payload: Any) -> Any:
    """An Ollama body as admission reads an OpenAI one: ``options.num_predict`` is its
    ``max_tokens``."""
    if not isinstance(payload, dict):
        return payload
    options = payload.get("options")
    limit = options.get("num_predict") if isinstance(options, dict) else None
    view = {"model": payload.get("model")}
    if isinstance(limit, int) and not isinstance(limit, bool) and limit >= 1:
        view["max_tokens"] = limit
    return view


def add_ollama_routes(
    router: APIRouter,
    replicas: ReplicaSet,
    to_a_worker: Callable[[Request, str], Awaitable[Response]],
) -> None:
    """Ollama's listing routes on the daemon's router; ``to_a_worker`` forwards a body to a
    replica of the model it names."""

    def models(running: bool) -> dict[str, Any]:
        listed = []
        for card in replicas.model_cards():
            if running and not replicas.ready(card["id"]):
                continue
            name = card["id"]
            entry = {"name": name, "model": name, "size": 0,
                     "digest": hashlib.sha256(name.encode()).hexdigest(),
                     "details": details("", "")}  # fmt: skip
            if running:
                entry.update(expires_at="0001-01-01T00:00:00Z", size_vram=0,
                             context_length=card.get("max_model_len"))  # fmt: skip
            else:
                entry["modified_at"] = created_at()
            listed.append(entry)
        return {"models": listed}

    @router.get("/api/tags")
    async def tags() -> dict[str, Any]:
        """Every model served (Ollama's local models)."""
        return models(running=False)

    @router.get("/api/ps")
    async def ps() -> dict[str, Any]:
        """The models with a ready replica (Ollama's loaded models)."""
        return models(running=True)

    @router.get("/api/version")
    async def version() -> dict[str, str]:
        return {"version": kunlun.__version__}

    @router.post("/api/show")
    async def show(request: Request) -> Response:
        """The model's template, details and capabilities, from one of its replicas."""
        return await to_a_worker(request, "/api/show")
