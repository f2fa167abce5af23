"""Structured output against the real worker and gateway with the openai SDK: answers that
finish with ``stop`` parse and validate against their schema (many schemas, the demo model),
regex, grammar and choice constraints hold, and bad constraints are 400s naming the field."""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import jsonschema
import openai
import pytest
from tests.serving.conftest import MODEL, GatewayServer

MAX_TOKENS = 64
"""Room for every answer that stops (the longest, the book, takes 41 tokens with the demo
model); the two that run on (an unbounded number, an integer in ``anyOf``) are cut here as
at any other limit, and the batch ends with them instead of 100 steps later."""

SCHEMAS: list[tuple[str, dict[str, Any]]] = [
    ("Describe a person as JSON.", {
        "type": "object", "additionalProperties": False, "required": ["name", "age"],
        "properties": {"name": {"type": "string", "maxLength": 30},
                       "age": {"type": "integer", "minimum": 0, "maximum": 150}}}),
    ("What is the capital of France?", {
        "type": "object", "additionalProperties": False, "required": ["city"],
        "properties": {"city": {"type": "string", "enum": ["Paris", "Rome", "Berlin"]}}}),
    ("List a few prime numbers.", {
        "type": "array", "items": {"type": "integer"}, "minItems": 2, "maxItems": 5}),
    ("Give a product with its price.", {
        "type": "object", "additionalProperties": False, "required": ["product", "price", "stock"],
        "properties": {"product": {"type": "string", "maxLength": 24},
                       "price": {"type": "number", "minimum": 0},
                       "stock": {"type": "boolean"}}}),
    ("Give an airport code.", {
        "type": "object", "additionalProperties": False, "required": ["code"],
        "properties": {"code": {"type": "string", "pattern": "^[A-Z]{3}$"}}}),
    ("Describe a book and its author.", {
        "type": "object", "additionalProperties": False, "required": ["title", "author"],
        "properties": {"title": {"type": "string", "maxLength": 40},
                       "author": {"type": "object", "additionalProperties": False,
                                  "required": ["name", "born"],
                                  "properties": {"name": {"type": "string", "maxLength": 30},
                                                 "born": {"type": "integer"}}}}}),
    ("Is water wet? Answer yes or no with a confidence.", {
        "type": "object", "additionalProperties": False, "required": ["answer", "confidence"],
        "properties": {"answer": {"enum": ["yes", "no"]},
                       "confidence": {"type": "number", "minimum": 0, "maximum": 1}}}),
    ("Give either a number or a word.", {
        "anyOf": [{"type": "integer"}, {"type": "string", "maxLength": 12}]}),
    ("Name three colors.", {
        "type": "object", "additionalProperties": False, "required": ["colors"],
        "properties": {"colors": {"type": "array", "minItems": 3, "maxItems": 3,
                                  "items": {"type": "string", "maxLength": 12}}}}),
    ("Describe today's weather.", {
        "type": "object", "additionalProperties": False, "required": ["sky", "celsius"],
        "properties": {"sky": {"type": "string", "enum": ["clear", "cloudy", "rain"]},
                       "celsius": {"type": "integer", "minimum": -50, "maximum": 60}}}),
]  # fmt: skip


@pytest.fixture(scope="module")
def client(gateway: GatewayServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{gateway.base_url}/v1", api_key="x", max_retries=0)


def ask(client: openai.OpenAI, question: str, schema: dict[str, Any]) -> Any:
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema,
                                                  "strict": True}}  # fmt: skip
    return client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": question}], temperature=0,
        max_tokens=MAX_TOKENS, response_format=fmt,  # type: ignore[arg-type]
    )  # fmt: skip


def test_answers_that_stop_validate_against_their_schema(client: openai.OpenAI) -> None:
    with ThreadPoolExecutor(len(SCHEMAS)) as pool:  # one batch in the engine
        replies = list(pool.map(lambda qs: ask(client, *qs), SCHEMAS))
    stopped = 0
    for (question, schema), reply in zip(SCHEMAS, replies, strict=True):
        choice = reply.choices[0]
        if choice.finish_reason == "length":  # cut by max_tokens: says so, need not parse
            assert reply.usage.completion_tokens == MAX_TOKENS, (question, choice)
            continue
        assert choice.finish_reason == "stop", (question, choice)
        jsonschema.validate(json.loads(choice.message.content), schema)
        stopped += 1
    assert stopped >= len(SCHEMAS) - 2, [r.choices[0] for r in replies]


def test_json_object_mode_streams_one_object(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Describe a cat as JSON."}],
        temperature=0, max_tokens=MAX_TOKENS, stream=True,
        response_format={"type": "json_object"},
    )  # fmt: skip
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    reasons = [
        c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
    ]
    if reasons == ["stop"]:
        assert isinstance(json.loads(text), dict), text
    else:
        assert reasons == ["length"], reasons


def test_regex_choice_and_grammar_hold(client: openai.OpenAI) -> None:
    regex = r"(yes|no), because [a-z ]{5,40}\."
    reply = client.completions.create(
        model=MODEL, prompt="Is the sky blue? Answer:", max_tokens=40, temperature=0.7, seed=3,
        extra_body={"guided_regex": regex},
    )  # fmt: skip
    assert re.fullmatch(regex, reply.choices[0].text), reply.choices[0].text
    reply = client.completions.create(
        model=MODEL, prompt="My favourite color is", max_tokens=10, temperature=0,
        extra_body={"guided_choice": ["red", "green", "blue"]},
    )  # fmt: skip
    assert reply.choices[0].text in ("red", "green", "blue")
    assert reply.choices[0].finish_reason == "stop"
    gbnf = 'root ::= "The answer is " digit digit? "."\ndigit ::= [0-9]'
    reply = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "What is 6 times 7?"}],
        max_tokens=20, temperature=0, extra_body={"guided_grammar": gbnf},
    )  # fmt: skip
    assert re.fullmatch(r"The answer is [0-9]{1,2}\.", reply.choices[0].message.content or "")


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"guided_regex": "(unclosed"}, "guided_regex"),
        ({"guided_grammar": "root ::= ("}, "guided_grammar"),
        ({"guided_choice": []}, "guided_choice"),
        ({"response_format": {"type": "json_schema", "json_schema": {
            "name": "x", "schema": {"type": "nonsense"}}}}, "response_format.json_schema.schema"),
    ],
)  # fmt: skip
def test_a_bad_constraint_is_a_400_naming_its_field(
    client: openai.OpenAI, extra: dict[str, Any], param: str
) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4,
            extra_body=extra,
        )  # fmt: skip
    body = caught.value.body
    assert isinstance(body, dict) and body["param"] == param and param in body["message"], body
