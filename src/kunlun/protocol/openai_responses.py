"""OpenAI's Responses API (``POST /v1/responses``): the request, read as the chat completion
it asks for, and the response object and stream events built from the answer.

A request's ``input`` (a string, or items: messages, earlier ``function_call`` items and
their ``function_call_output``), ``instructions`` (a system message first), ``tools`` (the
Responses API's flat function tools), ``tool_choice``, ``text.format`` (``text``,
``json_object``, ``json_schema``: :mod:`kunlun.protocol.schemas` reads the schema as for chat)
and the sampling fields become a chat completion (:meth:`ResponsesRequest.chat`), so every
field is checked and honoured as there. The answer is a ``response`` object whose ``output``
holds a ``message`` item (its ``output_text``) and a ``function_call`` item per call; a stream
sends the Responses API's typed events (:class:`ResponseEvents`).

A worker keeps nothing: the daemon's gateway keeps answers and resolves
``previous_response_id`` into ``input`` before a request reaches a worker
(:mod:`kunlun.serving.response_state`), so here the field is refused (a request that did not
come through the gateway), and ``store`` is echoed. Fields the chat API ignores are ignored
here too (``metadata``, ``user``...).
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import Field

from kunlun.protocol.fields import StrictModel
from kunlun.protocol.openai_errors import error_status_and_body, param_error


class FunctionTool(StrictModel):
    type: Literal["function"]
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class NamedFunction(StrictModel):
    type: Literal["function"]
    name: str


class TextFormat(StrictModel):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    schema_: Annotated[dict[str, Any] | None, Field(alias="schema")] = None
    description: str | None = None
    strict: bool | None = None


class TextOptions(StrictModel):
    format: TextFormat | None = None
    verbosity: Literal["medium"] | None = None
    """Only the default (answer length is not steered)."""


class ResponsesRequest(StrictModel):
    """``POST /v1/responses``."""

    model: str
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0, le=2)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    stream: bool = False
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["auto", "none", "required"] | NamedFunction | None = None
    parallel_tool_calls: bool | None = None
    text: TextOptions | None = None
    truncation: Literal["disabled"] | None = None
    """Only ``disabled``: a conversation too long for the model is a 400, never cut."""
    previous_response_id: str | None = None
    """Resolved by the gateway, refused here (see the module docstring)."""
    store: bool | None = None
    """Whether the gateway keeps the answer (default: it does)."""
    # accepted and ignored, as on the chat API (IGNORED_FIELDS)
    metadata: dict[str, str] | None = None
    user: str | None = None
    safety_identifier: str | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None

    def chat(self) -> dict[str, Any]:
        """The body of the ``/v1/chat/completions`` request this one means."""
        if self.previous_response_id is not None:
            raise param_error("previous_response_id", "this endpoint keeps no responses: "
                              "the platform's gateway resolves previous_response_id; send "
                              "the whole conversation in input")  # fmt: skip
        messages = [{"role": "system", "content": self.instructions}] if self.instructions else []
        messages += input_messages(self.input)
        body: dict[str, Any] = {"model": self.model, "messages": messages, "stream": self.stream}
        if self.stream:
            body["stream_options"] = {"include_usage": True}
        for ours, theirs in (("max_output_tokens", "max_tokens"), ("temperature", "temperature"),
                             ("top_p", "top_p"), ("parallel_tool_calls", "parallel_tool_calls")):  # fmt: skip
            if getattr(self, ours) is not None:
                body[theirs] = getattr(self, ours)
        if self.tools:
            body["tools"] = [{"type": "function", "function": t.model_dump(
                exclude_none=True, exclude={"type"})} for t in self.tools]  # fmt: skip
        if isinstance(self.tool_choice, NamedFunction):
            body["tool_choice"] = {"type": "function", "function": {"name": self.tool_choice.name}}
        elif self.tool_choice is not None:
            body["tool_choice"] = self.tool_choice
        fmt = self.text.format if self.text else None
        if fmt is not None and fmt.type == "json_object":
            body["response_format"] = {"type": "json_object"}
        elif fmt is not None and fmt.type == "json_schema":
            body["response_format"] = {"type": "json_schema", "json_schema": {
                "name": fmt.name or "format", "schema": fmt.schema_, "strict": fmt.strict}}  # fmt: skip
        return body


def input_messages(given: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Chat messages from a request's ``input``."""
    if isinstance(given, str):
        return [{"role": "user", "content": given}]
    messages: list[dict[str, Any]] = []
    for index, item in enumerate(given):
        kind = item.get("type", "message")
        if kind == "message" and "role" in item:
            role = "system" if item["role"] == "developer" else item["role"]
            messages.append({"role": role, "content": _text(item.get("content"), index)})
        elif kind == "function_call":
            call = {"id": item.get("call_id"), "type": "function",
                    "function": {"name": item.get("name"), "arguments": item.get("arguments")}}  # fmt: skip
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and "tool_calls" in last:
                last["tool_calls"].append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            messages.append({"role": "tool", "tool_call_id": item.get("call_id"),
                             "content": _text(item.get("output"), index)})  # fmt: skip
        else:
            raise param_error(f"input.{index}.type", f"input items of type {kind!r} are not "
                              "supported: messages, function_call and function_call_output")  # fmt: skip
    return messages


def _text(content: Any, index: int) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            kind = part.get("type") if isinstance(part, dict) else None
            if kind not in ("input_text", "output_text", "text"):
                raise param_error(f"input.{index}.content",
                                  f"content parts of type {kind!r} are not supported: text only")  # fmt: skip
            parts.append(str(part.get("text", "")))
        return "".join(parts)
    raise param_error(f"input.{index}.content", "must be a string or a list of text parts")


def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def usage(chat_usage: dict[str, Any]) -> dict[str, Any]:
    """The Responses API's usage from the chat API's."""
    cached = (chat_usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return {"input_tokens": chat_usage["prompt_tokens"],
            "input_tokens_details": {"cached_tokens": cached},
            "output_tokens": chat_usage["completion_tokens"],
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": chat_usage["total_tokens"]}  # fmt: skip


def message_item(text: str, item_id: str | None = None, done: bool = True) -> dict[str, Any]:
    part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
    return {"type": "message", "id": item_id or _new_id("msg"), "role": "assistant",
            "status": "completed" if done else "in_progress",
            "content": [part] if done else []}  # fmt: skip


def call_item(call: dict[str, Any], done: bool = True) -> dict[str, Any]:
    """A ``function_call`` item from a chat ``tool_calls`` entry."""
    return {"type": "function_call", "id": _new_id("fc"), "call_id": call["id"],
            "name": call["function"]["name"], "arguments": call["function"]["arguments"],
            "status": "completed" if done else "in_progress"}  # fmt: skip


class Response:
    """One response object, filled as its answer comes."""

    def __init__(self, req: ResponsesRequest, previous: str | None = None) -> None:
        """``previous``: the ``previous_response_id`` the gateway resolved into the input."""
        self.req = req
        self.body: dict[str, Any] = {
            "id": _new_id("resp"), "object": "response", "created_at": int(time.time()),
            "status": "in_progress", "model": req.model, "output": [], "error": None,
            "incomplete_details": None, "instructions": req.instructions,
            "max_output_tokens": req.max_output_tokens, "temperature": req.temperature,
            "top_p": req.top_p, "parallel_tool_calls": req.parallel_tool_calls is not False,
            "tool_choice": "auto" if req.tool_choice is None else (
                req.tool_choice if isinstance(req.tool_choice, str)
                else req.tool_choice.model_dump()),
            "tools": [t.model_dump(exclude_none=True) for t in req.tools or []],
            "text": {"format": (req.text.format.model_dump(by_alias=True, exclude_none=True)
                                if req.text and req.text.format else {"type": "text"})},
            "previous_response_id": previous, "store": req.store is not False,
            "truncation": "disabled",
            "metadata": req.metadata or {}, "usage": None,
        }  # fmt: skip

    def finish(self, finish_reason: str | None, chat_usage: dict[str, Any]) -> dict[str, Any]:
        if finish_reason == "length":
            self.body["status"] = "incomplete"
            self.body["incomplete_details"] = {"reason": "max_output_tokens"}
        else:
            self.body["status"] = "completed"
        self.body["usage"] = usage(chat_usage)
        return self.body

    def whole(self, message: dict[str, Any], finish_reason: str | None,
              chat_usage: dict[str, Any]) -> dict[str, Any]:  # fmt: skip
        """The response to a finished chat answer (its message as the chat API writes it)."""
        if message.get("content"):
            self.body["output"].append(message_item(message["content"]))
        for call in message.get("tool_calls") or []:
            self.body["output"].append(call_item(call))
        return self.finish(finish_reason, chat_usage)


class ResponseEvents:
    """The Responses API's stream events of one answer, from the chat stream's pieces: text
    (:meth:`text`), tool-call deltas as :class:`~kunlun.serving.worker_stream.ToolCallDeltas`
    writes them (:meth:`calls`) and the end (:meth:`done`)."""

    def __init__(self, response: Response) -> None:
        self.response = response
        self.number = 0
        self.message: dict[str, Any] | None = None  # the message item being written
        self.text_so_far = ""
        self.calls: dict[int, dict[str, Any]] = {}  # tool-call index -> its item

    def event(self, kind: str, **fields: Any) -> bytes:
        body = {"type": kind, "sequence_number": self.number, **fields}
        self.number += 1
        data = json.dumps(body, ensure_ascii=False, separators=(",", ":"))
        return f"event: {kind}\ndata: {data}\n\n".encode()

    def start(self) -> list[bytes]:
        body = self.response.body
        return [self.event("response.created", response=body),
                self.event("response.in_progress", response=body)]  # fmt: skip

    def _index(self, item: dict[str, Any]) -> int:
        return int(self.response.body["output"].index(item))

    def text(self, delta: str) -> list[bytes]:
        out = []
        if self.message is None:
            self.message = message_item("", done=False)
            self.response.body["output"].append(self.message)
            index = self._index(self.message)
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            out += [self.event("response.output_item.added", output_index=index, item=self.message),
                    self.event("response.content_part.added", item_id=self.message["id"],
                               output_index=index, content_index=0, part=part)]  # fmt: skip
        self.text_so_far += delta
        out.append(self.event("response.output_text.delta", item_id=self.message["id"],
                              output_index=self._index(self.message), content_index=0,
                              delta=delta, logprobs=[]))  # fmt: skip
        return out

    def tool_calls(self, pieces: list[dict[str, Any]]) -> list[bytes]:
        out = []
        for piece in pieces:
            item = self.calls.get(piece["index"])
            function = piece.get("function") or {}
            if item is None:
                call = {"id": piece["id"], "function": {"name": function.get("name"),
                                                        "arguments": ""}}  # fmt: skip
                item = self.calls[piece["index"]] = call_item(call, done=False)
                self.response.body["output"].append(item)
                out.append(self.event("response.output_item.added",
                                      output_index=self._index(item), item=item))  # fmt: skip
            delta = function.get("arguments") or ""
            if delta:
                item["arguments"] += delta
                out.append(self.event("response.function_call_arguments.delta",
                                      item_id=item["id"], output_index=self._index(item),
                                      delta=delta))  # fmt: skip
        return out

    def done(self, finish_reason: str | None, chat_usage: dict[str, Any]) -> list[bytes]:
        out = []
        if self.message is not None:
            index, text = self._index(self.message), self.text_so_far
            part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
            self.message.update(status="completed", content=[part])
            out += [self.event("response.output_text.done", item_id=self.message["id"],
                               output_index=index, content_index=0, text=text, logprobs=[]),
                    self.event("response.content_part.done", item_id=self.message["id"],
                               output_index=index, content_index=0, part=part),
                    self.event("response.output_item.done", output_index=index,
                               item=self.message)]  # fmt: skip
        for item in self.calls.values():
            item["status"] = "completed"
            index = self._index(item)
            out += [self.event("response.function_call_arguments.done", item_id=item["id"],
                               output_index=index, arguments=item["arguments"]),
                    self.event("response.output_item.done", output_index=index, item=item)]  # fmt: skip
        body = self.response.finish(finish_reason, chat_usage)
        kind = "response.incomplete" if body["status"] == "incomplete" else "response.completed"
        return [*out, self.event(kind, response=body)]


def error_event(exc: BaseException) -> bytes:
    """The event that ends a stream that failed."""
    error = error_status_and_body(exc)[1]["error"]
    body = {"type": "error", "code": error.get("code"), "message": error.get("message"),
            "param": error.get("param"), "sequence_number": 0}  # fmt: skip
    return f"event: error\ndata: {json.dumps(body, ensure_ascii=False)}\n\n".encode()
