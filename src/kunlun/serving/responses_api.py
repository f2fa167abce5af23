"""``POST /v1/responses`` on the engine worker: OpenAI's Responses API, run as the chat
completion it means (:mod:`kunlun.protocol.openai_responses`), answered as a ``response``
object or, with ``stream``, as the Responses API's typed SSE events (text as
``response.output_text.delta``, a tool call's arguments as
``response.function_call_arguments.delta`` while written, ``response.completed`` last)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import Response

from kunlun.headers import PREVIOUS_RESPONSE
from kunlun.limits import CLIENT_GONE
from kunlun.protocol import sse
from kunlun.protocol.openai_api import ChatCompletionRequest
from kunlun.protocol.openai_responses import (
    Response as ResponseObject,
)
from kunlun.protocol.openai_responses import (
    ResponseEvents,
    ResponsesRequest,
    error_event,
)
from kunlun.protocol.request_body import parse_request
from kunlun.protocol.tools import ToolUse
from kunlun.serving.worker_calls import Call, json_response, new_call, off_loop_if_large
from kunlun.serving.worker_core import StartChat, WorkerCore
from kunlun.serving.worker_stream import Deltas, ToolCallDeltas


class ResponsesRoute:
    """``POST /v1/responses`` of one worker (``start_chat``: its chat route's start)."""

    def __init__(self, worker: WorkerCore, start_chat: StartChat) -> None:
        self.worker, self.start_chat = worker, start_chat

    async def __call__(self, request: Request) -> Response:
        raw = await request.body()
        call = new_call(request)
        req = await off_loop_if_large(raw, parse_request, ResponsesRequest, raw)
        chat = parse_request(ChatCompletionRequest, json.dumps(req.chat()).encode())
        submitted, tools, _ = await self.start_chat(request, raw, chat)
        response = ResponseObject(req, request.headers.get(PREVIOUS_RESPONSE))
        worker = self.worker
        if req.stream:
            events = _events(worker.deltas(call, submitted.streams), call, tools, response)
            return worker.sse(call, submitted, events, sse.MEDIA_TYPE, error_event)
        outputs = await worker.collect(request, call, submitted)
        if outputs is None:
            return worker.finish(call, Response(status_code=CLIENT_GONE))
        output = outputs[0].outputs[0]
        message, finish = tools.answer(output.text, output.finish_reason)
        return worker.finish(call, json_response(call, response.whole(message, finish,
                                                                      call.usage())))  # fmt: skip


async def _events(
    deltas: Deltas, call: Call, tools: ToolUse, response: ResponseObject
) -> AsyncIterator[bytes]:
    events = ResponseEvents(response)
    for event in events.start():
        yield event
    calls = ToolCallDeltas(tools)
    async for _, delta in deltas:
        text, pieces, finish = calls.read(delta)
        for event in [*(events.text(text) if text else []), *events.tool_calls(pieces)]:
            yield event
        if delta.finish_reason is not None:
            for event in events.done(finish, call.usage()):
                yield event
