"""Tool calling: OpenAI's ``tools``, ``tool_choice`` and ``parallel_tool_calls`` over any
model the engine serves.

The request's tools reach the model through its chat template. A template that takes
``tools`` (Qwen2.5, Qwen3, Llama 3.1...) renders them itself, and past calls and tool
results are passed as its messages (arguments decoded to objects, as templates expect). A
template that takes no tools (the demo model's) gets them in a system message that lists
the functions as JSON and asks for calls in the ``hermes`` format; past calls are written
back in that format, and tool results become user turns in ``<tool_response>`` tags.

``tool_choice``:

- ``auto`` (the default with tools): the model answers freely; calls written in the model's
  format (:mod:`kunlun.protocol.tool_formats`) are parsed out of the answer into
  ``tool_calls``; text that does not parse stays content.
- ``required``, or a named function: the engine's grammar engine holds the answer to one
  call (one or more with ``parallel_tool_calls``, the default) of the allowed functions,
  with arguments valid against their ``parameters`` schemas, so even a small model returns
  a usable call. With several calls allowed, a call that repeats an earlier one (same
  function, same arguments) ends the answer before it: it would ask for nothing new, and a
  small model that starts repeating does not stop until ``max_tokens``.
- ``none``: the template gets no tools and nothing is parsed.

An answer with calls that ended on its own finishes with ``tool_calls``. Tools with another
output constraint (``response_format``, ``guided_*``) are refused (400), since each would
hold the answer to a different form.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from functools import lru_cache
from typing import Annotated, Any, Literal

import jinja2
import jinja2.meta
from pydantic import Field

from kunlun.engine.guided import Guide
from kunlun.engine.sampling_params import SamplingParams
from kunlun.errors import Location, RequestError
from kunlun.protocol.fields import StrictModel
from kunlun.protocol.schemas import closed
from kunlun.protocol.tool_formats import ToolFormat, ToolStream, format_for_template

# ---- request objects ----


class FunctionDef(StrictModel):
    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")]
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None
    """With ``true``, every property of ``parameters`` is required of a call held to it
    (:mod:`kunlun.protocol.schemas`)."""


class ToolDef(StrictModel):
    type: Literal["function"]
    function: FunctionDef


class ChosenFunction(StrictModel):
    name: str


class NamedToolChoice(StrictModel):
    type: Literal["function"]
    function: ChosenFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class CalledFunction(StrictModel):
    name: str
    arguments: str


class MessageToolCall(StrictModel):
    """A call in an earlier assistant message, as the client sends it back."""

    id: str
    type: Literal["function"] = "function"
    function: CalledFunction


def _refused(param: str, message: str) -> RequestError:
    """A 400 whose ``param`` is ``param`` and whose message starts with it."""
    return RequestError(f"{param}: {message}", location=Location("request", field=param))


# ---- one request's use of tools ----


@dataclass(frozen=True)
class ToolUse:
    """What a chat request's tools change: the template's ``tools``, the messages, the
    output constraint, and how the answer is read (``format`` None: it is not)."""

    format: ToolFormat | None
    template_tools: list[dict[str, Any]] | None
    guide: Guide | None
    tools_in_template: bool
    """Whether the chat template renders tools itself."""
    several_calls: bool = False
    """Whether the grammar lets one call follow another (``required`` with
    ``parallel_tool_calls``)."""

    @staticmethod
    def of(
        tools: list[ToolDef] | None,
        choice: ToolChoice | None,
        parallel: bool | None,
        other_guide: str | None,
        template: str | None,
    ) -> ToolUse:
        """The use of ``tools`` under ``choice`` with this chat template; a 400 naming the
        field for a choice without tools, an unknown function, two tools of one name, or
        another output constraint (``other_guide``, its field name) beside them."""
        in_template = takes_tools(template)
        fmt = format_for_template(template if in_template else None)
        if not tools:
            if choice is not None and choice not in ("none", "auto"):
                raise _refused("tool_choice", "needs tools, and none were sent")
            return ToolUse(fmt, None, None, in_template)
        names = [t.function.name for t in tools]
        for index, name in enumerate(names):
            if name in names[:index]:
                raise _refused(f"tools.{index}.function.name", f"two tools are named {name!r}")
        if choice == "none":
            return ToolUse(None, None, None, in_template)
        if other_guide is not None:
            raise _refused(other_guide, "cannot be combined with tools "
                           "(each holds the answer to its own form); send one of them, or "
                           "tool_choice 'none'")  # fmt: skip
        allowed = tools
        if isinstance(choice, NamedToolChoice):
            allowed = [t for t in tools if t.function.name == choice.function.name]
            if not allowed:
                raise _refused("tool_choice.function.name", f"no tool is named "
                               f"{choice.function.name!r}; tools: {', '.join(names)}")  # fmt: skip
        guide = None
        if choice is not None and choice != "auto":
            schemas = [fmt.call_schema(t.function.name, _parameters(t)) for t in allowed]
            one = isinstance(choice, NamedToolChoice) or parallel is False
            guide = Guide("grammar", fmt.grammar(schemas, parallel=not one), "tools")
        dumped = [t.model_dump(exclude_none=True) for t in tools]
        return ToolUse(fmt, dumped, guide, in_template, several_calls=guide is not None and not one)

    def sampling(self, params: SamplingParams) -> SamplingParams:
        """``params`` held to this use's form: the calls' grammar (``required`` or a named
        function) and, where several calls may follow each other, the answer's end at a
        call that repeats an earlier one (:meth:`ToolFormat.repeat_end`)."""
        if self.guide is None or self.format is None:
            return params
        end = self.format.repeat_end if self.several_calls else None
        return dataclasses.replace(params, guide=self.guide, end_text=end)

    def cut(self, finish_reason: str | None) -> bool:
        """Whether an unfinished call at the end of an answer is dropped rather than sent as
        content: the answer was cut by ``max_tokens``, or a grammar held it to calls (where
        an answer ends inside a call, at a repeated one, none of its text is content)."""
        return finish_reason == "length" or self.guide is not None

    def messages(self, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The chat messages as this model's template should see them."""
        if self.tools_in_template:
            return [_decoded_calls(m) for m in messages]
        fmt = self.format or format_for_template(None)
        written = [_as_text(m, fmt) for m in messages]
        if not self.template_tools:
            return written
        prompt = _tools_prompt(self.template_tools)
        if written and written[0]["role"] == "system":
            first = dict(written[0], content=f"{written[0]['content']}\n\n{prompt}")
            return [first, *written[1:]]
        return [{"role": "system", "content": prompt}, *written]

    def template_variables(self) -> dict[str, Any]:
        """Extra variables of the chat template."""
        if self.tools_in_template and self.template_tools:
            return {"tools": self.template_tools}
        return {}

    @property
    def reads_calls(self) -> bool:
        """Whether answers are read for calls (:meth:`stream` gives a parser)."""
        return self.format is not None and bool(self.template_tools)

    def stream(self) -> ToolStream | None:
        """A parser for one streamed choice, or None when answers are not read for calls."""
        return self.format.stream() if self.reads_calls and self.format is not None else None

    def answer(self, text: str, finish_reason: str | None) -> tuple[dict[str, Any], str | None]:
        """The assistant message of a finished answer, and its finish reason."""
        if self.format is None or not self.template_tools:
            return {"role": "assistant", "content": text}, finish_reason
        cut = self.cut(finish_reason)
        content, calls = self.format.parse(text, cut)
        if not calls:  # a call cut by max_tokens leaves no markup in content
            return {"role": "assistant", "content": content if cut else text}, finish_reason
        message = {"role": "assistant", "content": content,
                   "tool_calls": [call.openai() for call in calls]}  # fmt: skip
        return message, "tool_calls" if finish_reason == "stop" else finish_reason


def _parameters(tool: ToolDef) -> Any:
    """The schema a call's arguments are held to: the tool's ``parameters`` read by
    :func:`kunlun.protocol.schemas.closed` (``strict`` as the tool says), or no keys at all
    for a tool without parameters."""
    if not tool.function.parameters:
        return {"type": "object", "properties": {}, "additionalProperties": False}
    return closed(tool.function.parameters, strict=bool(tool.function.strict))


@lru_cache(maxsize=16)
def takes_tools(template: str | None) -> bool:
    """Whether a chat template reads the ``tools`` variable."""
    if not template:
        return False
    try:
        variables = jinja2.meta.find_undeclared_variables(jinja2.Environment().parse(template))
    except jinja2.TemplateSyntaxError:
        return False
    return "tools" in variables


def _decoded_calls(message: dict[str, Any]) -> dict[str, Any]:
    """An assistant message whose calls' arguments are objects (templates write them out)."""
    calls = message.get("tool_calls")
    if not calls:
        return message
    decoded = []
    for call in calls:
        function = dict(call["function"])
        function["arguments"] = _arguments(function["arguments"])
        decoded.append({**call, "function": function})
    return {**message, "tool_calls": decoded}


def _arguments(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text


def _as_text(message: dict[str, Any], fmt: ToolFormat) -> dict[str, Any]:
    """A message with its tool calls or tool result written as text, for a template that
    knows only roles and content."""
    if message["role"] == "tool":
        return {"role": "user",
                "content": f"<tool_response>\n{message['content']}\n</tool_response>"}  # fmt: skip
    calls = message.get("tool_calls")
    if not calls:
        return {k: v for k, v in message.items() if k not in ("tool_calls", "tool_call_id")}
    written = [fmt.as_text(c["function"]["name"], _arguments(c["function"]["arguments"]))
               for c in calls]  # fmt: skip
    content = "\n".join(filter(None, [message.get("content") or "", *written]))
    return {"role": message["role"], "content": content}


def _tools_prompt(tools: list[dict[str, Any]]) -> str:
    listed = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    return (
        "You can call functions to answer. The functions are listed here as JSON, one per "
        f"line, between <tools> and </tools>:\n<tools>\n{listed}\n</tools>\n"
        "To call one, write a JSON object with its name and arguments between <tool_call> "
        "and </tool_call>, one block per call, like this:\n<tool_call>\n"
        '{"name": "function_name", "arguments": {"argument_name": "value"}}\n</tool_call>'
    )
