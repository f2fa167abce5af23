"""How a streamed tool call is cut into OpenAI deltas (``ToolCallDeltas``), fed the text of
a call the way an engine hands it out (a few characters at a time): a first delta with the
call's index, id, type and name as soon as the name is written, then its arguments in
pieces that add up to them; and whole, in one delta, where it cannot stream (written in one
piece, several calls allowed under a grammar, Ollama's mode)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from kunlun.engine.outputs import RequestOutputDelta
from kunlun.protocol.openai_api import ChatCompletionRequest
from kunlun.protocol.tool_formats import partial_call
from kunlun.serving.worker_stream import ToolCallDeltas

TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}  # fmt: skip
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris, \\"France\\" {x}"}}\n</tool_call>'


def deltas(choice: Any, text: str, size: int, whole: bool = False) -> list[Any]:
    """What :meth:`ToolCallDeltas.read` makes of ``text`` handed out ``size`` characters at
    a time, the last piece finishing the answer."""
    request = ChatCompletionRequest.model_validate({
        "model": "m", "messages": [{"role": "user", "content": "hi"}], "tools": [TOOL],
        "tool_choice": choice})  # fmt: skip
    reader = ToolCallDeltas(request.tool_use(None), whole=whole)
    pieces = [text[i : i + size] for i in range(0, len(text), size)]
    return [reader.read(RequestOutputDelta("r", 0, piece, [], finish_reason="stop"
                                           if n == len(pieces) - 1 else None))
            for n, piece in enumerate(pieces)]  # fmt: skip


NAMED = {"type": "function", "function": {"name": "get_weather"}}


@pytest.mark.parametrize("size", [1, 3, 7])
def test_a_call_streams_its_name_first_then_its_arguments(size: int) -> None:
    read = deltas(NAMED, CALL, size)
    parts = [p for _, pieces, _ in read for p in pieces]
    assert parts[0]["id"].startswith("call_") and parts[0]["type"] == "function"
    assert parts[0]["function"] == {"name": "get_weather", "arguments": ""}
    assert all(p["index"] == 0 and "id" not in p for p in parts[1:])
    arguments = "".join(p["function"]["arguments"] for p in parts)
    assert json.loads(arguments) == {"city": 'Paris, "France" {x}'}
    assert len(parts) >= 3  # the arguments in pieces, while written
    assert "".join(text for text, _, _ in read) == "" and read[-1][2] == "tool_calls"


@pytest.mark.parametrize(("choice", "size", "whole"), [
    (NAMED, len(CALL), False),  # written in one piece: nothing to stream before it ends
    ("required", 2, False),  # several calls may follow: a repeat is known once complete
    ("auto", 2, True),  # Ollama's mode
])  # fmt: skip
def test_a_call_comes_whole_where_it_cannot_stream(choice: Any, size: int, whole: bool) -> None:
    parts = [p for _, pieces, _ in deltas(choice, CALL, size, whole) for p in pieces]
    assert len(parts) == 1 and parts[0]["function"]["name"] == "get_weather", parts
    assert json.loads(parts[0]["function"]["arguments"])["city"].startswith("Paris")


def test_partial_calls_are_read_as_written() -> None:
    assert partial_call('{"name": "f", "arguments": {"a": [1, {"b": "}"}], "c": 2') == (
        "f",
        '{"a": [1, {"b": "}"}], "c": 2',
    )
    assert partial_call('{"name": "f", "arguments": {"a": 1}}\n') == ("f", '{"a": 1}')
    assert partial_call('{"arguments": {"name": "x"}') == (None, "")
    assert partial_call('{"name": "f\\u00e9", "arg') == ("fé", "")
