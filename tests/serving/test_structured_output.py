"""Structured output against the real worker and gateway with the openai SDK: answers that
finish with ``stop`` parse and validate against their schema (many schemas, the demo model),
regex, grammar and choice constraints hold, and bad constraints are 400s naming the field."""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor
from typing import Annotated, Any, Literal

import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field
from tests.serving.conftest import MODEL, GatewayServer

MAX_TOKENS = 96
"""Room for every answer: each schema below, read as the server reads schemas (objects
closed, integers held to 16 digits: :mod:`kunlun.protocol.schemas`), has answers that end,
and the demo model ends each well inside this."""


class Person(BaseModel):
    name: str = Field(max_length=30)
    age: int = Field(ge=0, le=150)


class Product(BaseModel):
    product: str = Field(max_length=24)
    price: float = Field(ge=0, le=10000)
    stock: bool


class Author(BaseModel):
    name: str = Field(max_length=30)
    born: int


class Book(BaseModel):
    title: str = Field(max_length=40)
    author: Author


class Colors(BaseModel):
    colors: list[Annotated[str, Field(max_length=12)]] = Field(min_length=3, max_length=3)


class Weather(BaseModel):
    sky: Literal["clear", "cloudy", "rain"]
    celsius: int = Field(ge=-50, le=60)


SCHEMAS: list[tuple[str, dict[str, Any]]] = [
    # written by pydantic, as clients (instructor, LangChain, the SDK's parse) send them:
    # every object left open, which the server closes
    ("Describe a person as JSON.", Person.model_json_schema()),
    ("Give a product with its price.", Product.model_json_schema()),
    ("Describe a book and its author.", Book.model_json_schema()),
    ("Name three colors.", Colors.model_json_schema()),
    ("Describe today's weather.", Weather.model_json_schema()),
    # written by hand
    ("What is the capital of France?", {
        "type": "object", "additionalProperties": False, "required": ["city"],
        "properties": {"city": {"type": "string", "enum": ["Paris", "Rome", "Berlin"]}}}),
    ("List a few prime numbers.", {
        "type": "array", "items": {"type": "integer"}, "minItems": 2, "maxItems": 5}),
    ("Give an airport code.", {
        "type": "object", "required": ["code"],
        "properties": {"code": {"type": "string", "pattern": "^[A-Z]{3}$"}}}),
    ("Is water wet? Answer yes or no with a confidence in percent.", {
        "type": "object", "required": ["answer", "confidence"],
        "properties": {"answer": {"enum": ["yes", "no"]},
                       "confidence": {"type": "integer", "minimum": 0, "maximum": 100}}}),
    ("Give either a number or a word.", {
        "anyOf": [{"type": "integer"}, {"type": "string", "maxLength": 12}]}),
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


def test_every_strict_answer_ends_and_validates(client: openai.OpenAI) -> None:
    """Issue 34: with schemas enforced exactly as written, pydantic's open objects let the
    demo model write key after key, and unbounded integers digit after digit, until
    ``max_tokens``; read as vLLM reads them, all ten answers now end and validate."""
    with ThreadPoolExecutor(len(SCHEMAS)) as pool:  # one batch in the engine
        replies = list(pool.map(lambda qs: ask(client, *qs), SCHEMAS))
    for (question, schema), reply in zip(SCHEMAS, replies, strict=True):
        choice = reply.choices[0]
        assert choice.finish_reason == "stop", (question, choice)
        jsonschema.validate(json.loads(choice.message.content), schema)


def test_json_object_mode_streams_one_object(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Describe a cat as JSON."}],
        temperature=0, max_tokens=64, stream=True,
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
