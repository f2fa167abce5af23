"""Requests for replicas served by an external engine (llama.cpp, vLLM, SGLang).

No Kunlun worker checks these, so the gateway does before sending one: the body must be a
valid request of Kunlun's own API at its path (the same 400s, naming the field), the path
must be one the engine serves, and the engine's adapter then words it as the engine takes
it, refusing by name any field it does not honour
(:meth:`~kunlun.engines.adapter.EngineAdapter.request_body`). Nothing is dropped silently.
"""

from __future__ import annotations

import json

from pydantic import BaseModel

from kunlun import json_text
from kunlun.engines.registry import engine_named
from kunlun.errors import EngineLacks, Location
from kunlun.protocol.embedding_request import served_for_generation
from kunlun.protocol.openai_api import ChatCompletionRequest, CompletionRequest
from kunlun.protocol.request_body import parse_request

EMBEDDINGS_PATH = "/v1/embeddings"
_REQUESTS: dict[str, type[BaseModel]] = {
    "/v1/chat/completions": ChatCompletionRequest,
    "/v1/completions": CompletionRequest,
}


def external_body(engine_name: str, path: str, body: bytes) -> bytes:
    """``body`` for ``path`` as engine ``engine_name`` takes it, or the 400 that refuses it."""
    engine = engine_named(engine_name)
    request = _REQUESTS.get(path)
    if path == EMBEDDINGS_PATH:  # external engines serve generation only
        raise served_for_generation(json_text.loads(body).get("model", ""))
    if request is None or path not in engine.serves:
        raise EngineLacks(
            f"{path} is not served by engine {engine.name}, which serves this model "
            f"(it answers {', '.join(engine.serves)})",
            location=Location("request", field="path"),
        )
    parse_request(request, body)
    payload = json_text.loads(body)
    return json.dumps(engine.request_body(path, payload), ensure_ascii=False).encode()
