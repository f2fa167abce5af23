"""Tool calling against the real worker and gateway, with the openai SDK and LangChain:
required and named tool choices give calls whose arguments validate against the tools'
schemas (even from the 135M demo model), streamed as OpenAI tool-call deltas; tools reach
the prompt; past calls and tool results can be sent back; bad tool requests are 400s naming
the field."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field
from tests.clients import pinned
from tests.serving.conftest import MODEL, GatewayServer

from kunlun.validate import tool_calling

WEATHER = tool_calling.WEATHER  # the validate row's tool (city of at most 40 characters)
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "The local time in a time zone.",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "string", "maxLength": 40}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}
TOOLS: list[Any] = [WEATHER, TIME]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "user", "content": "What is the weather in Paris right now?"}]


@pytest.fixture(scope="module")
def client(gateway: GatewayServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{gateway.base_url}/v1", api_key="x", max_retries=0)


def chat(client: openai.OpenAI, **fields: Any) -> Any:
    fields = {"messages": ASK, "max_tokens": 120, **fields}
    return client.chat.completions.create(model=MODEL, temperature=0, **fields)


def check_call(call: Any, names: set[str]) -> dict[str, Any]:
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name in names
    arguments = json.loads(call.function.arguments)
    jsonschema.validate(arguments, SCHEMAS[call.function.name])
    return arguments


def test_a_named_function_is_called_with_valid_arguments(client: openai.OpenAI) -> None:
    choice = {"type": "function", "function": {"name": "get_weather"}}
    reply = chat(client, tools=TOOLS, tool_choice=choice)
    answer = reply.choices[0]
    assert answer.finish_reason == "tool_calls", answer
    assert answer.message.content is None
    assert len(answer.message.tool_calls) == 1  # a named function: exactly one call
    check_call(answer.message.tool_calls[0], {"get_weather"})


def test_required_calls_one_of_the_tools(client: openai.OpenAI) -> None:
    reply = chat(client, tools=TOOLS, tool_choice="required", parallel_tool_calls=False)
    answer = reply.choices[0]
    assert answer.finish_reason == "tool_calls"
    assert len(answer.message.tool_calls) == 1
    check_call(answer.message.tool_calls[0], {"get_weather", "get_time"})
    several = chat(client, tools=TOOLS, tool_choice="required").choices[0]
    assert several.finish_reason == "tool_calls" and several.message.tool_calls
    for call in several.message.tool_calls:
        check_call(call, {"get_weather", "get_time"})
    assert len({c.id for c in several.message.tool_calls}) == len(several.message.tool_calls)


def test_a_call_cut_by_max_tokens_leaves_no_markup_in_content(client: openai.OpenAI) -> None:
    """Issue 32: a call cut short by ``max_tokens`` was sent as content, ``<tool_call>``
    markup and half a JSON object; it is dropped (no call, no content), streamed or not."""
    choice = {"type": "function", "function": {"name": "get_weather"}}
    answer = chat(client, tools=TOOLS, tool_choice=choice, max_tokens=6).choices[0]
    assert answer.finish_reason == "length"
    assert not answer.message.tool_calls and not answer.message.content, answer.message
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Weather in Paris?"}], tools=TOOLS,
        tool_choice=choice, max_tokens=6, stream=True))  # fmt: skip
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert "<tool_call>" not in streamed and "{" not in streamed, streamed
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == "length"


def test_a_streamed_call_arrives_as_tool_call_deltas(client: openai.OpenAI) -> None:
    choice = {"type": "function", "function": {"name": "get_weather"}}
    whole = chat(client, tools=TOOLS, tool_choice=choice).choices[0].message.tool_calls[0]
    stream = chat(client, tools=TOOLS, tool_choice=choice, stream=True)
    calls: dict[int, dict[str, Any]] = {}
    finish, content, pieces = None, "", []
    for chunk in stream:
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        content += delta.content or ""
        pieces += delta.tool_calls or []
        for part in delta.tool_calls or []:
            entry = calls.setdefault(part.index, {"id": None, "name": "", "arguments": ""})
            entry["id"] = part.id or entry["id"]
            if part.function is not None:
                entry["name"] += part.function.name or ""
                entry["arguments"] += part.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls" and content == ""
    assert list(calls) == [0]
    assert calls[0]["name"] == "get_weather" and calls[0]["id"].startswith("call_")
    assert json.loads(calls[0]["arguments"]) == json.loads(whole.function.arguments)  # greedy
    # issue 34: the name first, at once, then the arguments as they are written
    assert pieces[0].function.name == "get_weather" and pieces[0].id == calls[0]["id"]
    assert not pieces[0].function.arguments and len(pieces) >= 3, pieces
    assert all(p.id is None and p.function.name is None for p in pieces[1:])


def test_tools_reach_the_prompt_unless_the_choice_is_none(client: openai.OpenAI) -> None:
    plain = chat(client, max_tokens=1).usage.prompt_tokens
    with_tools = chat(client, tools=TOOLS, max_tokens=1).usage.prompt_tokens  # auto
    none = chat(client, tools=TOOLS, tool_choice="none", max_tokens=1).usage.prompt_tokens
    assert with_tools > plain + 40  # the two functions' JSON
    assert none == plain
    answer = chat(client, tools=TOOLS, max_tokens=40).choices[0]  # auto: text or calls
    if answer.message.tool_calls:
        assert answer.finish_reason in ("tool_calls", "length")
    else:
        assert answer.message.content


def test_past_calls_and_their_results_are_sent_back(client: openai.OpenAI) -> None:
    call = {"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}  # fmt: skip
    messages = [*ASK, {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "call_1", "content": '{"celsius": 21, "sky": "clear"}'}]  # fmt: skip
    plain = chat(client, max_tokens=1).usage.prompt_tokens
    reply = chat(client, tools=TOOLS, messages=messages, tool_choice="none", max_tokens=30)
    assert reply.usage.prompt_tokens > plain + 25  # the call and its result, as turns
    assert reply.choices[0].message.content
    assert reply.choices[0].message.tool_calls is None


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
         "tool_choice.function.name"),
        ({"tools": [WEATHER, WEATHER]}, "tools.1.function.name"),
        ({"tools": TOOLS, "response_format": {"type": "json_object"}}, "response_format"),
        ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]},
         "tools.0.function.name"),
        ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
        ({"functions": [WEATHER["function"]]}, "functions"),
    ],
)  # fmt: skip
def test_bad_tool_requests_are_400s_naming_the_field(
    client: openai.OpenAI, fields: dict[str, Any], param: str
) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=4, extra_body=fields)
    assert caught.value.body["param"] == param, caught.value.body  # type: ignore[index]


def test_langchain_bind_tools_and_structured_output(gateway: GatewayServer) -> None:
    from langchain_openai import ChatOpenAI

    class Weather(BaseModel):
        """The weather in a city."""

        city: str = Field(max_length=30)
        celsius: int = Field(ge=-50, le=60)

    llm = ChatOpenAI(model=MODEL, base_url=f"{gateway.base_url}/v1", api_key="x",
                     temperature=0, max_tokens=100, max_retries=0)  # fmt: skip
    bound = llm.bind_tools([WEATHER], tool_choice="get_weather")
    message = bound.invoke("What is the weather in Paris?")
    assert len(message.tool_calls) == 1
    assert message.tool_calls[0]["name"] == "get_weather"
    jsonschema.validate(message.tool_calls[0]["args"], SCHEMAS["get_weather"])
    for method in ("function_calling", "json_schema"):
        weather = llm.with_structured_output(Weather, method=method).invoke(
            "The weather in Rome today, as data."
        )
        assert isinstance(weather, Weather), (method, weather)


def test_required_with_parallel_calls_ends_before_a_repeated_call(client: openai.OpenAI) -> None:
    """Issue 32: under ``required`` with parallel calls allowed (the default), the demo model
    wrote the same call again and again until ``max_tokens`` (``length``, ``<tool_`` in the
    content). A call that repeats an earlier one now ends the answer before it, with
    ``tool_calls``, non-streamed and through the SDK's ``stream()`` helper (which raises
    ``LengthFinishReasonError`` on ``length``)."""
    ask = [{"role": "user", "content": "What time is it in Tokyo, and is it raining in London?"}]
    strict = [{**t, "function": {**t["function"], "strict": True}} for t in TOOLS]
    whole = chat(client, messages=ask, tools=strict, tool_choice="required", max_tokens=200)
    answer = whole.choices[0]
    assert answer.finish_reason == "tool_calls" and not answer.message.content, answer
    calls = [(c.function.name, check_call(c, set(SCHEMAS))) for c in answer.message.tool_calls]
    assert len({json.dumps(c, sort_keys=True) for c in calls}) == len(calls) >= 1, calls
    with client.chat.completions.stream(model=MODEL, messages=ask, tools=strict,
                                        tool_choice="required", max_tokens=200,
                                        temperature=0) as stream:  # fmt: skip
        final = stream.get_final_completion().choices[0]
    assert final.finish_reason == "tool_calls" and not final.message.content
    assert [(c.function.name, json.loads(c.function.arguments)) for c in
            final.message.tool_calls or []] == calls  # fmt: skip


class Forecast(BaseModel):
    """The forecast for a city (pydantic writes its schema with the object left open)."""

    city: str = Field(max_length=30)
    days: int = Field(ge=1, le=7)


def test_a_tool_written_by_pydantic_is_called_and_ends(client: openai.OpenAI) -> None:
    """Issue 34: a schema without ``additionalProperties`` let the demo model paste keys
    into the arguments until ``max_tokens``; objects are now closed unless a schema opens
    them (:mod:`kunlun.protocol.schemas`), so the call ends (the SDK's ``stream()`` helper
    under ``required``: ``test_required_with_parallel_calls_ends_before_a_repeated_call``)."""
    schema = Forecast.model_json_schema()
    assert "additionalProperties" not in schema
    tool = {"type": "function", "function": {"name": "forecast", "parameters": schema}}
    choice = {"type": "function", "function": {"name": "forecast"}}
    ask = [{"role": "user", "content": "Give me the forecast for Paris for the next days."}]
    answer = chat(client, messages=ask, tools=[tool], tool_choice=choice).choices[0]
    assert answer.finish_reason == "tool_calls" and answer.message.content is None, answer
    Forecast.model_validate_json(answer.message.tool_calls[0].function.arguments)


def test_instructor_tools_and_json_schema_modes(gateway: GatewayServer) -> None:
    instructor = pinned("instructor")
    base = openai.OpenAI(base_url=f"{gateway.base_url}/v1", api_key="x", max_retries=0)
    for mode in (instructor.Mode.TOOLS, instructor.Mode.JSON_SCHEMA):
        patched = instructor.from_openai(base, mode=mode)
        forecast = patched.chat.completions.create(
            model=MODEL, response_model=Forecast, temperature=0, max_tokens=120,
            max_retries=1, messages=[{"role": "user", "content": "Forecast for Rome, 3 days."}],
        )  # fmt: skip
        assert isinstance(forecast, Forecast), (mode, forecast)
