"""The worker's streamed chat and text completions: SSE chunks in OpenAI's shape from the
engine's deltas (:meth:`~kunlun.serving.worker_core.WorkerCore.deltas`).

Each chunk carries the new text of one choice (the first of a chat choice also its
``role``), its logprobs when asked, and its finish reason on the last; with
``stream_options.include_usage`` a last chunk with ``choices: []`` carries the usage (and,
with vLLM's ``continuous_usage_stats``, every chunk the usage so far); ``[DONE]`` ends the
stream. A delta that adds nothing a client sees (text held back: a partial character, a
possible stop string) sends no chunk. In a chat with tools, text that may start a tool call
is held back and each call is sent whole, as one ``tool_calls`` delta, once written
(:class:`ToolCallDeltas`); a completion with ``echo`` starts each choice with its prompt.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

from kunlun.engine.outputs import RequestOutputDelta
from kunlun.protocol import responses, sse
from kunlun.protocol.openai_api import ChatCompletionRequest, CompletionRequest
from kunlun.protocol.tool_formats import ToolStream
from kunlun.protocol.tools import ToolUse
from kunlun.serving.worker_calls import Call

Deltas = AsyncIterator[tuple[int, RequestOutputDelta]]
"""Engine deltas, each tagged with the index of its prompt."""


async def chat_events(
    deltas: Deltas,
    call: Call,
    req: ChatCompletionRequest,
    response_id: str,
    tokens: responses.TokenText,
    top_k: int | None,
    tools: ToolUse,
) -> AsyncIterator[bytes]:
    """The SSE events of a streamed chat completion."""
    created, with_usage = int(time.time()), req.include_usage
    started: set[int] = set()
    calls = ToolCallDeltas(tools)
    async for _, delta in deltas:
        wants_logprobs = top_k is not None and bool(delta.logprobs)
        text, tool_calls, finish_reason = calls.read(delta)
        if not (text or tool_calls or finish_reason or wants_logprobs):
            continue  # text held back (partial character, stop string, call)
        message: dict[str, Any] = {"content": text}
        if delta.index not in started:
            started.add(delta.index)
            message = {"role": "assistant", "content": text}
        if tool_calls:
            message["content"] = text or None
            message["tool_calls"] = tool_calls
        logprobs = None
        if wants_logprobs:
            logprobs = responses.chat_logprobs(
                tokens, delta.token_ids, delta.logprobs or [], top_k or 0
            )
        choice = {"index": delta.index, "delta": message, "logprobs": logprobs,
                  "finish_reason": finish_reason}  # fmt: skip
        running = call.usage() if req.continuous_usage else None
        yield sse.event(responses.chunk(response_id, "chat.completion.chunk", created,
                                        req.model, [choice], running, with_usage))  # fmt: skip
    if with_usage:
        body = responses.chunk(response_id, "chat.completion.chunk", created, req.model, [],
                               call.usage(), True)  # fmt: skip
        yield sse.event(body)
    yield sse.DONE


async def completion_events(
    deltas: Deltas,
    call: Call,
    req: CompletionRequest,
    response_id: str,
    tokens: responses.TokenText,
    top_k: int | None,
    echo_texts: list[str] | None,
) -> AsyncIterator[bytes]:
    """The SSE events of a streamed text completion (choice ``prompt x n + index``)."""
    created, with_usage = int(time.time()), req.include_usage
    offsets: dict[int, int] = {}
    async for prompt_index, delta in deltas:
        index = prompt_index * req.n + delta.index
        text = delta.text
        if echo_texts is not None and index not in offsets:
            text = echo_texts[prompt_index] + text
        wants_logprobs = top_k is not None and bool(delta.logprobs)
        if not (text or delta.finish_reason or wants_logprobs):
            continue
        offset = offsets.get(index, 0)
        offsets[index] = offset + len(text)
        logprobs = None
        if wants_logprobs:
            logprobs = responses.completion_logprobs(
                tokens, delta.token_ids, delta.logprobs or [], top_k or 0,
                offset + len(text) - len(delta.text),
            )  # fmt: skip
        choice = {"index": index, "text": text, "logprobs": logprobs,
                  "finish_reason": delta.finish_reason}  # fmt: skip
        running = call.usage() if req.continuous_usage else None
        yield sse.event(responses.chunk(
            response_id, "text_completion", created, req.model, [choice], running, with_usage
        ))  # fmt: skip
    if with_usage:
        yield sse.event(responses.chunk(
            response_id, "text_completion", created, req.model, [], call.usage(), True
        ))  # fmt: skip
    yield sse.DONE


class ToolCallDeltas:
    """Reads each streamed choice for tool calls: text that may start a call is held back,
    each call is sent whole as one ``tool_calls`` delta once written."""

    def __init__(self, tools: ToolUse) -> None:
        self.tools = tools
        self.streams: dict[int, ToolStream | None] = {}
        self.sent: dict[int, int] = {}
        self.seen: set[tuple[int, str]] = set()
        """(choice, :attr:`ToolCall.key`) of the calls sent: where calls may follow each
        other, a repeat that was streamed before the engine ended the answer at it is not
        sent."""

    def read(self, delta: RequestOutputDelta) -> tuple[str, list[dict[str, Any]], str | None]:
        """``(content, tool-call deltas, finish reason)`` of one engine delta."""
        index = delta.index
        if index not in self.streams:
            self.streams[index] = self.tools.stream()
        stream = self.streams[index]
        if stream is None:
            return delta.text, [], delta.finish_reason
        text, calls = stream.feed(delta.text)
        if delta.finish_reason is not None:
            rest, more = stream.finish(cut=self.tools.cut(delta.finish_reason))
            text, calls = text + rest, calls + more
        if self.tools.several_calls:
            calls = [c for c in calls if (index, c.key) not in self.seen]
            self.seen.update((index, c.key) for c in calls)
        first = self.sent.get(index, 0)
        self.sent[index] = first + len(calls)
        finish = delta.finish_reason
        if finish == "stop" and self.sent[index]:
            finish = "tool_calls"
        return text, [c.openai(first + k) for k, c in enumerate(calls)], finish
