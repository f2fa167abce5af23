"""Server-sent events as the OpenAI API streams them: ``data: {json}\\n\\n`` then ``[DONE]``.

A stream that fails ends with one error event in the OpenAI error shape and no ``[DONE]``.
"""

from __future__ import annotations

import json
from typing import Any

from kunlun.protocol.openai_errors import error_json

MEDIA_TYPE = "text/event-stream"
DONE = b"data: [DONE]\n\n"
ERROR_EVENT_START = b'data: {"error"'
"""How an error event (:func:`error_event`) starts; generated text inside an event is
JSON-escaped, so a body piece holding this holds one."""


def whole_events(data: bytes) -> int:
    """How many bytes at the start of ``data`` are whole events: up to the end of its last
    blank line (``\\n\\n`` or ``\\r\\n\\r\\n``); 0 when no event in it has ended."""
    if data.endswith(b"\n\n"):  # a worker's write: whole events (no scan of the piece)
        return len(data)
    ends = [at + len(blank) for blank in (b"\n\n", b"\r\n\r\n") if (at := data.rfind(blank)) >= 0]
    return max(ends, default=0)


_ENCODER = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"))
"""Made once: ``json.dumps`` with options builds an encoder per call (a quarter of the time
of a stream's event)."""


def dumps(obj: Any) -> bytes:
    """Compact UTF-8 JSON, as every Kunlun response body is encoded."""
    return _ENCODER.encode(obj).encode()


def event(obj: Any) -> bytes:
    """One ``data:`` event carrying ``obj`` as JSON."""
    return b"data: " + dumps(obj) + b"\n\n"


def error_event(exc: BaseException) -> bytes:
    """The event that ends a failed stream: ``{"error": {...}}`` for ``exc``."""
    return b"data: " + error_json(exc) + b"\n\n"
