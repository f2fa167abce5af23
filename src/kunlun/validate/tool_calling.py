"""Tool calling: the server turns a model's answer into OpenAI ``tool_calls`` and takes the
call and its result back in the conversation.

One row, ``api.tools``. ``tool_choice: "required"`` with one function (greedy): the answer
finishes with ``tool_calls`` and holds exactly calls of that function, each with an id and
arguments that are a JSON object valid against the function's parameters. Then the calls and
their results go back as the next turns: the server must accept them (template rendering of
past calls and ``role: tool`` messages) and answer in text. A server that serves the model
but cannot enforce ``required`` fails here: a small model asked nicely does not call tools
reliably, which is why the row holds servers to the enforced form.
"""

from __future__ import annotations

import json
from typing import Any

import jsonschema

from kunlun.validate.check import Check, Context, check
from kunlun.validate.client import choice_text
from kunlun.validate.conformance import short
from kunlun.validate.matrix import Cell, failed, passed

CHECKS: list[Check] = []

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 40},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
ASK = [{"role": "user", "content": "What is the weather in Paris, in celsius?"}]
TOOL_TOKENS = 192
REPLY_TOKENS = 16


@check(CHECKS, "api.tools", "tool calling (tool_choice required)")
def tools(ctx: Context) -> Cell:
    """``tools`` with ``tool_choice: "required"``: valid calls, finish ``tool_calls``; the
    call and its result sent back are answered in text."""
    answer = ctx.client.chat("tools", ASK, tools=[WEATHER], tool_choice="required",
                             max_tokens=TOOL_TOKENS, temperature=0)  # fmt: skip
    message = answer.choice.get("message") or {}
    reason = answer.choice.get("finish_reason")
    if reason != "tool_calls":
        return failed(f"finish {reason}", f"expected tool_calls; message {short(message)}")
    problem = _calls_problem(message.get("tool_calls"))
    if problem:
        return failed("bad tool_calls", problem)
    calls = message["tool_calls"]
    result = json.dumps({"temperature": 18, "unit": "celsius", "sky": "clear"})
    turns = [*ASK, {"role": "assistant", "content": message.get("content"), "tool_calls": calls},
             *({"role": "tool", "tool_call_id": c["id"], "content": result} for c in calls)]  # fmt: skip
    reply = ctx.client.chat("tools", turns, tools=[WEATHER], max_tokens=REPLY_TOKENS,
                            temperature=0)  # fmt: skip
    text = choice_text(reply.choice)
    if not text.strip():
        return failed("no reply", f"the turn after the tool result is empty: {short(reply.body)}")
    ctx.client.record("tools", text)
    arguments = calls[0]["function"]["arguments"]
    return passed(f"{len(calls)} call(s)", f"get_weather({arguments}) -> {text}")


def _calls_problem(calls: Any) -> str | None:
    """Why ``calls`` are not well-formed calls of :data:`WEATHER`, or None."""
    if not isinstance(calls, list) or not calls:
        return f"no tool_calls in the message: {short(calls)}"
    schema = WEATHER["function"]["parameters"]  # type: ignore[index]
    for index, call in enumerate(calls):
        where = f"tool_calls[{index}]"
        if not isinstance(call, dict) or call.get("type") != "function":
            return f"{where} is not a function call: {short(call)}"
        if not isinstance(call.get("id"), str) or not call["id"]:
            return f"{where} has no id"
        function = call.get("function") or {}
        if function.get("name") != "get_weather":
            return f"{where} calls {function.get('name')!r}, not get_weather"
        arguments = function.get("arguments")
        if not isinstance(arguments, str):
            return f"{where}.function.arguments is not a JSON string: {short(arguments)}"
        try:
            jsonschema.validate(json.loads(arguments), schema)
        except ValueError as exc:
            return f"{where}.function.arguments is not JSON ({exc}): {short(arguments)}"
        except jsonschema.ValidationError as exc:
            return f"{where}.function.arguments {arguments} violate the parameters: {exc.message}"
    return None
