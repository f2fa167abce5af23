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
from collections.abc import AsyncIterator, Callable
from typing import Any

from kunlun.engine.outputs import RequestOutputDelta
from kunlun.protocol import responses, sse
from kunlun.protocol.openai_api import ChatCompletionRequest, CompletionRequest
from kunlun.protocol.tool_formats import ToolStream
from kunlun.protocol.tools import ToolUse
from kunlun.serving.worker_calls import Call

Deltas = AsyncIterator[tuple[int, RequestOutputDelta]]
"""Engine deltas, each tagged with the index of its prompt."""


class EngineWrites:
    """A plain stream's events written by the engine thread (:meth:`AsyncLLMEngine.attach_sink
    <kunlun.engine.async_engine.AsyncLLMEngine.attach_sink>`): once the event loop has written
    the stream's first event to a direct answer, each later delta that does not end it is
    made into its event and written to the client's connection right after the step, with no
    wake-up of the event loop; the delta that ends it, and any the connection will not take
    now, go through the event loop as before (which attaches the engine's writing again after
    its next event). The event's bytes are made by the same ``event`` the event loop calls.

    ``write``: ``handoff_worker._Exchange.write_now``; ``attach``: the engine's
    ``attach_sink`` for the stream's one request."""

    def __init__(
        self,
        attach: Callable[[str, Callable[[RequestOutputDelta], bool]], bool],
        request_id: str,
        write: Callable[[bytes], bool],
        call: Call,
    ) -> None:
        self.attach_sink, self.request_id, self.write, self.call = attach, request_id, write, call
        self.event: Callable[[int, RequestOutputDelta], bytes | None] | None = None

    def attach(self, event: Callable[[int, RequestOutputDelta], bytes | None]) -> None:
        """From the event loop, after it wrote an event: the engine thread writes the next."""
        self.event = event
        self.attach_sink(self.request_id, self)

    def __call__(self, delta: RequestOutputDelta) -> bool:
        """On the engine thread: write ``delta``'s event (True), or leave it to the loop."""
        if delta.final is not None or delta.finish_reason is not None or self.event is None:
            return False
        body = self.event(0, delta)
        if body is not None and not self.write(body):
            return False
        self.call.observe(0, delta)  # as the event loop counts the deltas it takes
        return True


async def _events(
    deltas: Deltas,
    event: Callable[[int, RequestOutputDelta], bytes | None],
    end: Callable[[], list[bytes]],
    writes: EngineWrites | None,
) -> AsyncIterator[bytes]:
    """Each delta's event (none for one that adds nothing a client sees), then the ending
    events; with ``writes``, the engine thread writes what it can in between."""
    async for prompt_index, delta in deltas:
        body = event(prompt_index, delta)
        if body is not None:
            yield body
            if writes is not None and delta.finish_reason is None:
                writes.attach(event)
    for body in end():
        yield body


class _Chunks:
    """What the events of one streamed answer share: its id, time, model and usage."""

    obj = ""
    """The chunks' ``object``."""

    def __init__(
        self,
        call: Call,
        req: ChatCompletionRequest | CompletionRequest,
        response_id: str,
        tokens: responses.TokenText,
        top_k: int | None,
    ) -> None:
        self.call, self.req, self.response_id, self.tokens = call, req, response_id, tokens
        self.top_k = top_k
        self.created, self.with_usage = int(time.time()), req.include_usage

    def _event(self, choice: dict[str, Any]) -> bytes:
        running = self.call.usage() if self.req.continuous_usage else None
        return sse.event(responses.chunk(self.response_id, self.obj, self.created,
                                         self.req.model, [choice], running,
                                         self.with_usage))  # fmt: skip

    def end(self) -> list[bytes]:
        """The usage event (when asked for) and ``[DONE]``."""
        if not self.with_usage:
            return [sse.DONE]
        body = responses.chunk(self.response_id, self.obj, self.created, self.req.model, [],
                               self.call.usage(), True)  # fmt: skip
        return [sse.event(body), sse.DONE]


class ChatChunks(_Chunks):
    """The events of a streamed chat completion, one engine delta at a time."""

    obj = "chat.completion.chunk"

    def __init__(
        self,
        call: Call,
        req: ChatCompletionRequest,
        response_id: str,
        tokens: responses.TokenText,
        top_k: int | None,
        tools: ToolUse,
    ) -> None:
        super().__init__(call, req, response_id, tokens, top_k)
        self.started: set[int] = set()
        self.calls = ToolCallDeltas(tools)

    def event(self, _: int, delta: RequestOutputDelta) -> bytes | None:
        """``delta``'s event; None when it adds nothing a client sees."""
        wants_logprobs = self.top_k is not None and bool(delta.logprobs)
        text, tool_calls, finish_reason = self.calls.read(delta)
        if not (text or tool_calls or finish_reason or wants_logprobs):
            return None  # text held back (partial character, stop string, call)
        message: dict[str, Any] = {"content": text}
        if delta.index not in self.started:
            self.started.add(delta.index)
            message = {"role": "assistant", "content": text}
        if tool_calls:
            message["content"] = text or None
            message["tool_calls"] = tool_calls
        logprobs = None
        if wants_logprobs:
            logprobs = responses.chat_logprobs(
                self.tokens, delta.token_ids, delta.logprobs or [], self.top_k or 0
            )
        return self._event({"index": delta.index, "delta": message, "logprobs": logprobs,
                            "finish_reason": finish_reason})  # fmt: skip


def chat_events(
    deltas: Deltas,
    call: Call,
    req: ChatCompletionRequest,
    response_id: str,
    tokens: responses.TokenText,
    top_k: int | None,
    tools: ToolUse,
    writes: EngineWrites | None = None,
) -> AsyncIterator[bytes]:
    """The SSE events of a streamed chat completion."""
    chunks = ChatChunks(call, req, response_id, tokens, top_k, tools)
    return _events(deltas, chunks.event, chunks.end, writes)


class CompletionChunks(_Chunks):
    """The events of a streamed text completion (choice ``prompt x n + index``), one engine
    delta at a time."""

    obj = "text_completion"

    def __init__(
        self,
        call: Call,
        req: CompletionRequest,
        response_id: str,
        tokens: responses.TokenText,
        top_k: int | None,
        echo_texts: list[str] | None,
    ) -> None:
        super().__init__(call, req, response_id, tokens, top_k)
        self.n, self.echo_texts = req.n, echo_texts
        self.offsets: dict[int, int] = {}

    def event(self, prompt_index: int, delta: RequestOutputDelta) -> bytes | None:
        """``delta``'s event; None when it adds nothing a client sees."""
        index = prompt_index * self.n + delta.index
        text = delta.text
        if self.echo_texts is not None and index not in self.offsets:
            text = self.echo_texts[prompt_index] + text
        wants_logprobs = self.top_k is not None and bool(delta.logprobs)
        if not (text or delta.finish_reason or wants_logprobs):
            return None
        offset = self.offsets.get(index, 0)
        self.offsets[index] = offset + len(text)
        logprobs = None
        if wants_logprobs:
            logprobs = responses.completion_logprobs(
                self.tokens, delta.token_ids, delta.logprobs or [], self.top_k or 0,
                offset + len(text) - len(delta.text),
            )  # fmt: skip
        return self._event({"index": index, "text": text, "logprobs": logprobs,
                            "finish_reason": delta.finish_reason})  # fmt: skip


def completion_events(
    deltas: Deltas,
    call: Call,
    req: CompletionRequest,
    response_id: str,
    tokens: responses.TokenText,
    top_k: int | None,
    echo_texts: list[str] | None,
    writes: EngineWrites | None = None,
) -> AsyncIterator[bytes]:
    """The SSE events of a streamed text completion (choice ``prompt x n + index``)."""
    chunks = CompletionChunks(call, req, response_id, tokens, top_k, echo_texts)
    return _events(deltas, chunks.event, chunks.end, writes)


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
