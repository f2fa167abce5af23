"""The worker's streamed chat and text completions: SSE chunks in OpenAI's shape from the
engine's deltas (:meth:`~kunlun.serving.worker_core.WorkerCore.deltas`).

Each chunk carries the new text of one choice (the first of a chat choice also its
``role``), its logprobs when asked, and its finish reason on the last; with
``stream_options.include_usage`` a last chunk with ``choices: []`` carries the usage (and,
with vLLM's ``continuous_usage_stats``, every chunk the usage so far); ``[DONE]`` ends the
stream. A delta that adds nothing a client sees (text held back: a partial character, a
possible stop string) sends no chunk. In a chat with tools, text that may start a tool call
is held back, and a call is streamed as OpenAI streams one (:class:`ToolCallDeltas`): its
id and name as soon as the name is written, then its arguments as they are written; a
completion with ``echo`` starts each choice with its prompt.
"""

from __future__ import annotations

import time
import uuid
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
    """Reads each streamed choice for tool calls: text that may start a call is held back;
    a call's first delta carries its index, id, type and name as soon as the name is written,
    the next ones the arguments written since, which add up to the call's arguments. A call
    the format cannot read before it is complete (``llama3_json``), and every call where
    several may follow each other under a grammar (``tool_choice: required`` with parallel
    calls: a repeat of an earlier call is only known once complete, and is not sent), is
    sent whole in one delta."""

    def __init__(self, tools: ToolUse, whole: bool = False) -> None:
        """``whole``: every call in one delta once written (Ollama's way)."""
        self.tools = tools
        self.whole = whole
        self.streams: dict[int, ToolStream | None] = {}
        self.sent: dict[int, int] = {}
        """Per choice: the calls begun (their indexes are 0, 1, ...)."""
        self.writing: dict[int, tuple[str, str]] = {}
        """Per choice: the call being streamed, as (id, arguments sent so far)."""
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
        out = []
        for call in calls:
            written = self.writing.pop(index, None)
            if written is None:  # sent whole
                out.append(call.openai(self.sent.get(index, 0)))
                self.sent[index] = self.sent.get(index, 0) + 1
            else:  # its name and the start of its arguments are out: the rest of them
                rest = stream.raw_arguments(call)[len(written[1]) :]
                if rest:
                    out.append({"index": self.sent[index] - 1, "function": {"arguments": rest}})
        if not (self.whole or self.tools.several_calls) and delta.finish_reason is None:
            out += self._writing(index, stream)
        finish = delta.finish_reason
        if finish == "stop" and self.sent.get(index):
            finish = "tool_calls"
        return text, out, finish

    def _writing(self, index: int, stream: ToolStream) -> list[dict[str, Any]]:
        """The deltas of the call being written in choice ``index``, since the last ones."""
        name, arguments = stream.partial()
        if name is None:  # no call is being written (one that was is no call after all)
            self.writing.pop(index, None)
            return []
        out = []
        if index not in self.writing:
            call_id = f"call_{uuid.uuid4().hex[:24]}"
            self.writing[index] = (call_id, "")
            self.sent[index] = self.sent.get(index, 0) + 1
            out.append({"index": self.sent[index] - 1, "id": call_id, "type": "function",
                        "function": {"name": name, "arguments": ""}})  # fmt: skip
        call_id, sent = self.writing[index]
        if len(arguments) > len(sent):
            out.append({"index": self.sent[index] - 1,
                        "function": {"arguments": arguments[len(sent) :]}})  # fmt: skip
            self.writing[index] = (call_id, arguments)
        return out
