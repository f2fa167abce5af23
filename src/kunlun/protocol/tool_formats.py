"""How a model family writes a tool call: the parser registry.

A :class:`ToolFormat` knows one way models write calls in their text, and does three things
with it: parse a finished answer into content and calls (:meth:`ToolFormat.parse`), parse a
streamed answer as it comes (:meth:`ToolFormat.stream`, which holds back text that may be
the start of a call), and give the Lark grammar that makes the engine write only well-formed
calls to the named functions with arguments valid against their schemas
(:meth:`ToolFormat.grammar`, used for ``tool_choice: required`` and a named function).

The formats (:data:`TOOL_FORMATS`):

``hermes``
    ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``, one block per call:
    the format of Qwen2.5, Qwen3, Hermes and many fine-tunes, and the one Kunlun teaches a
    model whose chat template does not take tools (:mod:`kunlun.protocol.tools`).
``llama3_json``
    The whole answer is a JSON object ``{"name": ..., "parameters": {...}}`` (several
    separated by ``;``), optionally after ``<|python_tag|>``: Llama 3.1 to 3.3.

:func:`format_for_template` picks one from the chat template's text.
"""

from __future__ import annotations

import json
import re
import uuid
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

_PYTHON_TAG = "<|python_tag|>"


@dataclass(frozen=True)
class ToolCall:
    """One parsed call: the function's name and its arguments as JSON text."""

    name: str
    arguments: str
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    @property
    def key(self) -> str:
        """What makes two calls the same call (function and arguments, whatever the
        arguments' key order or spacing): the identity :meth:`ToolFormat.repeat_end` uses."""
        return _call_key([self.name, json.loads(self.arguments)])

    def openai(self, index: int | None = None) -> dict[str, Any]:
        """The call as OpenAI's ``tool_calls`` entry (with ``index`` in a stream delta)."""
        entry: dict[str, Any] = {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }
        return entry if index is None else {"index": index, **entry}


def _call_from(obj: Any, arguments_key: str) -> ToolCall | None:
    """A call from a decoded JSON object, or None when it is not one."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    arguments = obj.get(arguments_key, obj.get("arguments", {}))
    if isinstance(arguments, str):
        try:
            json.loads(arguments)
        except ValueError:
            return None
        return ToolCall(obj["name"], arguments)
    if not isinstance(arguments, dict):
        return None
    return ToolCall(obj["name"], json.dumps(arguments, ensure_ascii=False))


def _objects(text: str) -> list[Any] | None:
    """The JSON values of ``text`` written one after another (separated by whitespace or
    ``;``), or None when it is anything else."""
    decoder, at = json.JSONDecoder(), 0
    values: list[Any] = []
    while True:
        while at < len(text) and (text[at].isspace() or text[at] == ";"):
            at += 1
        if at == len(text):
            return values or None
        try:
            value, at = decoder.raw_decode(text, at)
        except ValueError:
            return None
        values.append(value)


class ToolStream(ABC):
    """Parses one streamed answer: :meth:`feed` each text delta, then :meth:`finish`; each
    gives ``(content, calls)``: the text to send as content now and the calls completed."""

    @abstractmethod
    def feed(self, text: str) -> tuple[str, list[ToolCall]]:
        """The next text delta in: the content to send now and the calls it completed."""

    @abstractmethod
    def finish(self, cut: bool = False) -> tuple[str, list[ToolCall]]:
        """What is left once the answer ended; ``cut``: it ended at ``max_tokens``, so an
        unfinished call is dropped, never sent as content (its markup is no answer)."""

    def partial(self) -> tuple[str | None, str]:
        """The call being written now, as :func:`partial_call` reads it: ``(name,
        arguments so far)``; ``(None, "")`` when none is, or the format cannot say before
        the call is complete (then calls are sent whole)."""
        return None, ""

    def raw_arguments(self, call: ToolCall) -> str:
        """The arguments of a completed call as written (``call.arguments`` is them
        re-encoded): what the deltas of a call streamed while written add up to."""
        return call.arguments


class ToolFormat(ABC):
    """One way of writing tool calls (see the module's docstring)."""

    name = ""

    def parse(self, text: str, cut: bool = False) -> tuple[str | None, list[ToolCall]]:
        """``(content, calls)`` of a finished answer (``cut``: at ``max_tokens``); content
        None when only calls."""
        stream = self.stream()
        content, calls = stream.feed(text)
        rest, more = stream.finish(cut)
        content = (content + rest).strip()
        return content or None, calls + more

    @abstractmethod
    def stream(self) -> ToolStream:
        """A parser of one streamed answer in this format."""

    @abstractmethod
    def grammar(self, call_schemas: list[dict[str, Any]], parallel: bool) -> str:
        """A Lark grammar of one call (or, ``parallel``, one or more) to one of the functions
        whose JSON schemas (``{"name": const, arguments: schema}``) are given."""

    def repeat_end(self, text: str) -> int | None:
        """Where an answer of calls written under this format's grammar ends when its last
        complete call repeats an earlier one (same function, same arguments): the end of the
        call before the repeat; None while there is no repeat. Called as the answer grows
        (:attr:`kunlun.engine.sampling_params.SamplingParams.end_text`): a repeated call
        asks for nothing new, and a small model that starts repeating repeats until
        ``max_tokens``."""
        return None

    def call_schema(self, name: str, parameters: dict[str, Any]) -> dict[str, Any]:
        """The JSON schema of one call of function ``name`` in this format."""
        arguments = self.arguments_key
        return {
            "type": "object",
            "properties": {"name": {"const": name}, arguments: parameters},
            "required": ["name", arguments],
            "additionalProperties": False,
        }

    arguments_key = "arguments"

    @abstractmethod
    def as_text(self, name: str, arguments: Any) -> str:
        """A past call written back into a prompt as the model would have written it."""


def _call_key(value: Any) -> str:
    """One spelling of a call's JSON, so that calls differing only in key order or spacing
    compare equal."""
    return json.dumps(value, sort_keys=True, ensure_ascii=False)


def _union(call_schemas: list[dict[str, Any]]) -> str:
    schema = call_schemas[0] if len(call_schemas) == 1 else {"anyOf": call_schemas}
    return json.dumps(schema, ensure_ascii=False)


class _HermesStream(ToolStream):
    OPEN, CLOSE = "<tool_call>", "</tool_call>"

    def __init__(self) -> None:
        self.buffer = ""
        self.in_call = False
        self.held_space = ""  # content that is only whitespace so far: sent with what follows
        self.written: dict[str, str] = {}  # call id -> its arguments as written

    def partial(self) -> tuple[str | None, str]:
        return partial_call(self.buffer) if self.in_call else (None, "")

    def raw_arguments(self, call: ToolCall) -> str:
        return self.written.get(call.id, call.arguments)

    def _call(self, body: str) -> ToolCall | None:
        call = _call_from(_single(body), "arguments")
        if call is not None:
            self.written[call.id] = partial_call(body)[1] or call.arguments
        return call

    def feed(self, text: str) -> tuple[str, list[ToolCall]]:
        self.buffer += text
        content, calls = "", []
        while True:
            if self.in_call:
                end = self.buffer.find(self.CLOSE)
                if end < 0:
                    break
                call = self._call(self.buffer[:end])
                if call is None:  # not a call after all: its text is content
                    content += self.OPEN + self.buffer[: end + len(self.CLOSE)]
                else:
                    calls.append(call)
                self.buffer = self.buffer[end + len(self.CLOSE) :]
                self.in_call = False
                continue
            start = self.buffer.find(self.OPEN)
            if start >= 0:
                content += self.buffer[:start]
                self.buffer = self.buffer[start + len(self.OPEN) :]
                self.in_call = True
                continue
            keep = _partial_suffix(self.buffer, self.OPEN)
            content += self.buffer[: len(self.buffer) - keep]
            self.buffer = self.buffer[len(self.buffer) - keep :]
            break
        return self._content(content), calls

    def finish(self, cut: bool = False) -> tuple[str, list[ToolCall]]:
        rest, self.buffer = self.buffer, ""
        if cut and not self.in_call:
            rest = ""  # held back as the start of a call's tag ("<tool_"): markup, not content
        if self.in_call:  # an unclosed last call (the answer ended at its end, or was cut)
            self.in_call = False
            call = self._call(rest)
            if call is not None:
                return "", [call]
            if cut:
                return "", []
            rest = self.OPEN + rest
        return (self.held_space + rest).rstrip() if rest.strip() else "", []

    def _content(self, text: str) -> str:
        text, self.held_space = self.held_space + text, ""
        stripped = text.rstrip()
        self.held_space = text[len(stripped) :]
        return stripped


_NAME = re.compile(r'"name"\s*:\s*"((?:[^"\\]|\\.)*)"')
_ARGUMENTS = re.compile(r'"arguments"\s*:\s*')


def partial_call(body: str) -> tuple[str | None, str]:
    """What a call being written already says: its function's name, once written whole
    before its arguments (as the call's grammar writes them), and the text of its arguments
    so far (``""`` before they start; the whole value once complete, nothing after it).
    ``body`` is the call's JSON text so far."""
    arguments = _ARGUMENTS.search(body)
    name = _NAME.search(body)
    if name is None or (arguments is not None and name.start() > arguments.start()):
        return None, ""
    try:
        decoded = json.loads(f'"{name.group(1)}"')
    except ValueError:
        return None, ""
    if arguments is None:
        return decoded, ""
    return decoded, _json_value_prefix(body[arguments.end() :])


def _json_value_prefix(text: str) -> str:
    """The longest start of ``text`` that lies within the one JSON value it begins with."""
    depth, in_string, escaped = 0, False, False
    for at, char in enumerate(text):
        if in_string:
            if escaped:
                escaped = False
            elif char == "\\":
                escaped = True
            elif char == '"':
                in_string = False
                if depth == 0:
                    return text[: at + 1]
        elif char == '"':
            in_string = True
        elif char in "{[":
            depth += 1
        elif char in "}]":
            depth -= 1
            if depth <= 0:
                return text[: at + 1]
        elif depth == 0 and char in ",}\n" and at > 0:
            return text[:at].rstrip()  # a number, true, false or null ends here
    return text


def _single(text: str) -> Any:
    values = _objects(text)
    return values[0] if values is not None and len(values) == 1 else None


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest end of ``text`` that is a proper start of ``marker``."""
    for size in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0


class Hermes(ToolFormat):
    name = "hermes"

    def stream(self) -> ToolStream:
        return _HermesStream()

    def grammar(self, call_schemas: list[dict[str, Any]], parallel: bool) -> str:
        more = ' ("\\n" call)*' if parallel else ""
        return (
            f"start: call{more}\n"
            f'call: "<tool_call>\\n" %json {_union(call_schemas)} "\\n</tool_call>"\n'
        )

    def as_text(self, name: str, arguments: Any) -> str:
        body = json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False)
        return f"<tool_call>\n{body}\n</tool_call>"

    def repeat_end(self, text: str) -> int | None:
        opening, closing = _HermesStream.OPEN, _HermesStream.CLOSE
        if not text.rstrip().endswith(closing):
            return None  # only a call that just closed can be a repeat
        seen: set[str] = set()
        previous_end = at = 0
        while (start := text.find(opening, at)) >= 0:
            end = text.find(closing, start)
            if end < 0:
                return None
            values = _objects(text[start + len(opening) : end])
            key = _call_key(values) if values is not None else text[start:end].strip()
            if key in seen:
                return previous_end
            seen.add(key)
            previous_end = at = end + len(closing)
        return None


class _Llama3Stream(ToolStream):
    def __init__(self) -> None:
        self.text = ""
        self.calls_first: bool | None = None  # decided by the first character written

    def feed(self, text: str) -> tuple[str, list[ToolCall]]:
        if self.calls_first is False:
            return text, []
        self.text += text
        start = self.text.lstrip()
        if not start or _PYTHON_TAG.startswith(start):
            return "", []  # not decided yet
        self.calls_first = start.startswith(("{", _PYTHON_TAG))
        if self.calls_first:
            return "", []
        return self.text, []

    def finish(self, cut: bool = False) -> tuple[str, list[ToolCall]]:
        if self.calls_first is False:
            return "", []
        text = self.text.strip().removeprefix(_PYTHON_TAG)
        values = _objects(text)
        calls = [_call_from(v, "parameters") for v in values or []]
        if values is None or any(c is None for c in calls):
            return ("" if cut else self.text.strip()), []
        return "", [c for c in calls if c is not None]


class Llama3Json(ToolFormat):
    name = "llama3_json"
    arguments_key = "parameters"

    def stream(self) -> ToolStream:
        return _Llama3Stream()

    def grammar(self, call_schemas: list[dict[str, Any]], parallel: bool) -> str:
        more = ' ("; " call)*' if parallel else ""
        return f"start: call{more}\ncall: %json {_union(call_schemas)}\n"

    def as_text(self, name: str, arguments: Any) -> str:
        return json.dumps({"name": name, "parameters": arguments}, ensure_ascii=False)

    def repeat_end(self, text: str) -> int | None:
        if not text.rstrip().endswith(";"):
            return None  # a call is known complete when the separator after it is written
        decoder, seen = json.JSONDecoder(), set()
        previous_end = at = 0
        while True:
            while at < len(text) and text[at].isspace():
                at += 1
            try:
                value, end = decoder.raw_decode(text, at)
            except ValueError:
                return None
            key = _call_key(value)
            if key in seen:
                return previous_end
            seen.add(key)
            previous_end = at = end
            while at < len(text) and text[at].isspace():
                at += 1
            if at == len(text) or text[at] != ";":
                return None
            at += 1


TOOL_FORMATS: dict[str, ToolFormat] = {f.name: f for f in (Hermes(), Llama3Json())}
"""The parser registry: format name -> format."""


def format_for_template(template: str | None) -> ToolFormat:
    """The format a model with this chat template writes calls in: ``llama3_json`` for a
    template that speaks of ``<|python_tag|>`` or ``"parameters"`` without ``<tool_call>``,
    else ``hermes`` (also what Kunlun teaches models whose template takes no tools)."""
    text = template or ""
    if "<tool_call>" not in text and ("<|python_tag|>" in text or '"parameters"' in text):
        return TOOL_FORMATS["llama3_json"]
    return TOOL_FORMATS["hermes"]
