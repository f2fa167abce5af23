"""OpenAI's Responses API through the real gateway and worker (the demo model), with the
openai SDK's own ``responses`` methods: plain, streamed (its typed events), tools (a call as
a ``function_call`` item, its arguments streamed while written, and the result sent back)
and structured output (``responses.parse`` into a pydantic model); what is not kept or not
implemented is a 400 naming the field."""

from __future__ import annotations

import json
from typing import Literal

import openai
import pytest
from pydantic import BaseModel, Field
from tests.serving.conftest import MODEL, GatewayServer


@pytest.fixture(scope="module")
def client(gateway: GatewayServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{gateway.base_url}/v1", api_key="x", max_retries=0)


def test_plain_and_streamed(client: openai.OpenAI) -> None:
    reply = client.responses.create(model=MODEL, input="What is the capital of France?",
                                    instructions="Answer in one word.", temperature=0,
                                    max_output_tokens=16)  # fmt: skip
    assert reply.object == "response" and reply.status in ("completed", "incomplete")
    assert "Paris" in reply.output_text
    assert reply.usage.input_tokens > 0 and 0 < reply.usage.output_tokens <= 16
    events = list(client.responses.create(model=MODEL, input="What is the capital of France?",
                                          instructions="Answer in one word.", temperature=0,
                                          max_output_tokens=16, stream=True))  # fmt: skip
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] in ("response.completed", "response.incomplete")
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == reply.output_text == events[-1].response.output_text  # greedy: the same
    assert [e.sequence_number for e in events] == list(range(len(events)))
    with client.responses.stream(model=MODEL, input="What is the capital of France?",
                                 instructions="Answer in one word.", temperature=0,
                                 max_output_tokens=16) as stream:  # fmt: skip
        if reply.status == "incomplete":  # cut: the SDK's helper wants a completed response
            with pytest.raises(RuntimeError, match="response.completed"):
                stream.get_final_response()
        else:
            assert stream.get_final_response().output_text == reply.output_text


WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city.",
           "parameters": {"type": "object", "properties": {"city": {"type": "string",
                                                                    "maxLength": 30}},
                          "required": ["city"]}}  # fmt: skip


def test_tools_calls_and_their_results(client: openai.OpenAI) -> None:
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    reply = client.responses.create(model=MODEL, input=ask, tools=[WEATHER],
                                    tool_choice={"type": "function", "name": "get_weather"},
                                    temperature=0, max_output_tokens=60)  # fmt: skip
    calls = [item for item in reply.output if item.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_weather", reply.output
    assert set(json.loads(calls[0].arguments)) == {"city"}
    events = list(client.responses.create(model=MODEL, input=ask, tools=[WEATHER],
                                          tool_choice="required", parallel_tool_calls=False,
                                          temperature=0, max_output_tokens=60, stream=True))  # fmt: skip
    pieces = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert len(pieces) >= 2 and "".join(pieces) == done[0].arguments  # streamed while written
    assert json.loads(done[0].arguments) == json.loads(calls[0].arguments)
    answer = client.responses.create(model=MODEL, temperature=0, max_output_tokens=30,
                                     tools=[WEATHER], input=[*ask, calls[0].model_dump(),
                                     {"type": "function_call_output", "call_id": calls[0].call_id,
                                      "output": '{"celsius": 21, "sky": "clear"}'}])  # fmt: skip
    assert answer.output_text and not any(i.type == "function_call" for i in answer.output)


class Capital(BaseModel):
    country: Literal["France", "Italy", "Spain"]
    city: str = Field(max_length=20)


def test_structured_output_parses(client: openai.OpenAI) -> None:
    parsed = client.responses.parse(model=MODEL, input="What is the capital of France?",
                                    text_format=Capital, temperature=0,
                                    max_output_tokens=60)  # fmt: skip
    assert isinstance(parsed.output_parsed, Capital), parsed.output_text
    assert parsed.output_parsed.country == "France"


@pytest.mark.parametrize(("fields", "param"), [
    ({"previous_response_id": "resp_1"}, "previous_response_id"),
    ({"reasoning": {"effort": "high"}}, "reasoning"),
    ({"input": [{"type": "input_image", "image_url": "x"}]}, "input.0.type"),
])  # fmt: skip
def test_what_is_not_served_is_a_400_naming_it(
    client: openai.OpenAI, fields: dict[str, object], param: str
) -> None:
    body = {"model": MODEL, "input": "hi", "max_output_tokens": 4, **fields}
    with pytest.raises(openai.BadRequestError) as caught:
        client.post("/responses", body=body, cast_to=object)
    assert caught.value.body["param"] == param, caught.value.body  # type: ignore[index]


def test_previous_response_id_continues_a_kept_conversation(client: openai.OpenAI) -> None:
    first = client.responses.create(model=MODEL, input="My name is Ada. Say hello to me.",
                                    temperature=0, max_output_tokens=12)  # fmt: skip
    assert first.store is True and first.previous_response_id is None
    second = client.responses.create(model=MODEL, input="What is my name?", temperature=0,
                                     max_output_tokens=12, previous_response_id=first.id)  # fmt: skip
    assert second.previous_response_id == first.id
    alone = client.responses.create(model=MODEL, input="What is my name?", temperature=0,
                                    max_output_tokens=12)  # fmt: skip
    # the kept turn went before the new question: its answer and about ten tokens of question
    grown = second.usage.input_tokens - alone.usage.input_tokens
    assert grown >= first.usage.output_tokens + 5, (second.usage, first.usage, alone.usage)
    events = list(client.responses.create(model=MODEL, input="And again?", temperature=0,
                                          max_output_tokens=8, stream=True,
                                          previous_response_id=second.id))  # fmt: skip
    done = events[-1].response
    assert done.previous_response_id == second.id
    assert done.usage.input_tokens > second.usage.input_tokens + second.usage.output_tokens
    third = client.responses.create(model=MODEL, input="Once more.", temperature=0,
                                    max_output_tokens=4, previous_response_id=done.id)  # fmt: skip
    assert third.previous_response_id == done.id  # a streamed answer is kept too


def test_a_response_made_with_store_false_or_unknown_cannot_be_continued(
    client: openai.OpenAI,
) -> None:
    unkept = client.responses.create(model=MODEL, input="Hi", max_output_tokens=4, store=False)
    assert unkept.store is False
    for missing in (unkept.id, "resp_made_up"):
        with pytest.raises(openai.BadRequestError) as caught:
            client.responses.create(model=MODEL, input="Hi", max_output_tokens=4,
                                    previous_response_id=missing)  # fmt: skip
        error = caught.value.body
        assert error["param"] == "previous_response_id", error  # type: ignore[index]
        assert f"no response {missing!r} is kept" in error["message"]  # type: ignore[index]


def test_a_kept_response_is_retrieved_and_deleted(client: openai.OpenAI) -> None:
    made = client.responses.create(model=MODEL, input="Hi", temperature=0, max_output_tokens=4)
    got = client.responses.retrieve(made.id)
    assert got.id == made.id and got.output_text == made.output_text
    assert got.usage.output_tokens == made.usage.output_tokens
    client.responses.delete(made.id)
    for call in (client.responses.retrieve, client.responses.delete):
        with pytest.raises(openai.NotFoundError) as caught:
            call(made.id)
        assert f"no response {made.id!r} is kept" in caught.value.body["message"]  # type: ignore[index]
    with pytest.raises(openai.BadRequestError):  # nor can it be continued
        client.responses.create(model=MODEL, input="Hi", max_output_tokens=4,
                                previous_response_id=made.id)  # fmt: skip
