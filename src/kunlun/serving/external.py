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
from kunlun.errors import Location, RequestError
from kunlun.serving.protocol import ChatCompletionRequest, CompletionRequest, parse_request

_REQUESTS: dict[str, type[BaseModel]] = {
    "/v1/chat/completions": ChatCompletionRequest,
    "/v1/completions": CompletionRequest,
}


def external_body(engine_name: str, path: str, body: bytes) -> bytes:
    """``body`` for ``path`` as engine ``engine_name`` takes it, or the 400 that refuses it."""
    engine = engine_named(engine_name)
    request = _REQUESTS.get(path)
    if request is None or path not in engine.serves:
        raise RequestError(
            f"{path} is not served by engine {engine.name}, which serves this model "
            f"(it answers {', '.join(engine.serves)})",
            location=Location("request", field="path"),
        )
    parse_request(request, body)
    payload = json_text.loads(body)
    return json.dumps(engine.request_body(path, payload), ensure_ascii=False).encode()
