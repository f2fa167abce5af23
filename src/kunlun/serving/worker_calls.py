"""One API call on the engine worker, as each of its route sets handles it.

The OpenAI routes (:mod:`kunlun.serving.worker_app`), SGLang's native ones
(:mod:`kunlun.serving.sglang_api`) and the embeddings route (:mod:`kunlun.serving.embeddings`)
each time a call from its arrival (:func:`new_call`, which keeps the request id the gateway
sent and marks a health check's probe), count its tokens into one :class:`Call` for the
request log line and the worker's metrics, read a large body off the event loop
(:func:`off_loop_if_large`) and answer JSON with the request id (:func:`json_response`).
Kept apart from the handlers so that each imports it, and none another's internals; free of
torch, since the daemon's gateway imports SGLang's routes.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
import uuid
from collections.abc import Callable
from typing import Any, TypeVar

from fastapi import Request
from fastapi.responses import Response

from kunlun import headers as http_headers
from kunlun.engine.outputs import RequestOutput, RequestOutputDelta
from kunlun.protocol import responses, sse
from kunlun.serving.faults import PROBE_HEADER

_T = TypeVar("_T")
THREAD_BODY_BYTES = 64 << 10
"""Bodies larger than this are parsed, and their prompts rendered and tokenized, in a thread
(smaller ones are cheaper in place). A JSON body is never shorter than the text it holds."""


@dataclasses.dataclass
class Call:
    """One API call as the log line reports it."""

    request_id: str
    started: float = dataclasses.field(default_factory=time.perf_counter)
    first_token: float | None = None
    status: int = 200
    num_completion: int = 0
    num_prompt: dict[int, int] = dataclasses.field(default_factory=dict)
    num_cached: dict[int, int] = dataclasses.field(default_factory=dict)
    finals: list[RequestOutput] = dataclasses.field(default_factory=list)  # telemetry
    probe: bool = False  # a health check's probe: logged and counted as such

    def observe(self, prompt_index: int, delta: RequestOutputDelta) -> None:
        if delta.final is not None:  # telemetry: engine timings of the finished request
            self.finals.append(delta.final)
        if delta.token_ids:
            if self.first_token is None:
                self.first_token = time.perf_counter()
            self.num_completion += len(delta.token_ids)
        self.num_prompt[prompt_index] = delta.num_prompt_tokens
        self.num_cached[prompt_index] = delta.num_cached_tokens

    def usage(self) -> dict[str, Any]:
        return responses.usage(
            sum(self.num_prompt.values()), self.num_completion, sum(self.num_cached.values())
        )

    def log_line(self) -> str:
        ttft = "-" if self.first_token is None else f"{(self.first_token - self.started) * 1e3:.1f}"
        e2e = (time.perf_counter() - self.started) * 1e3
        return (
            f"Request {self.request_id}: status={self.status} "
            f"prompt_tokens={sum(self.num_prompt.values())} "
            f"completion_tokens={self.num_completion} ttft_ms={ttft} e2e_ms={e2e:.1f}"
            + (" health_probe" if self.probe else "")
        )


def new_call(request: Request) -> Call:
    """The call of ``request``, timed from now, under the request id it came with (or a new
    one)."""
    return Call(
        request.headers.get(http_headers.REQUEST_ID) or uuid.uuid4().hex,
        probe=bool(request.headers.get(PROBE_HEADER)),
    )


def json_response(call: Call, body: Any) -> Response:
    """``body`` as the JSON answer of ``call`` (compact UTF-8, the request id in a header)."""
    return Response(sse.dumps(body), media_type="application/json",
                    headers={http_headers.REQUEST_ID: call.request_id})  # fmt: skip


async def off_loop_if_large(raw: bytes, function: Callable[..., _T], *args: Any) -> _T:
    """``function(*args)``, in a thread when ``raw`` (the body it reads) is large."""
    if len(raw) > THREAD_BODY_BYTES:
        return await asyncio.to_thread(function, *args)
    return function(*args)
