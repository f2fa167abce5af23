"""How request schemas are read (:mod:`kunlun.protocol.schemas`): objects that list properties
are closed unless the schema opens them, unbounded integers are held to JSON's exact range,
``strict`` requires every property, and the request's own schema is left as sent. Each rule
is checked as the requests carry it, down to the guide the engine compiles."""

from __future__ import annotations

import copy
import json
from typing import Any

import jsonschema
import pytest
from pydantic import BaseModel

from kunlun.protocol.openai_api import ChatCompletionRequest
from kunlun.protocol.schemas import SAFE_INTEGER, closed


class Author(BaseModel):
    name: str
    born: int | None = None


class Book(BaseModel):
    title: str
    authors: list[Author]


def test_objects_that_list_properties_are_closed_unless_opened() -> None:
    schema = Book.model_json_schema()  # pydantic leaves every object open
    sent = copy.deepcopy(schema)
    read = closed(schema)
    assert schema == sent  # the request's own object is not changed
    validator = jsonschema.Draft202012Validator(read)
    book = {"title": "T", "authors": [{"name": "A"}]}
    assert validator.is_valid(book)
    assert not validator.is_valid({**book, "isbn": "1"})  # the top object is closed
    assert not validator.is_valid({**book, "authors": [{"name": "A", "x": 1}]})  # and $defs'
    assert jsonschema.Draft202012Validator(schema).is_valid({**book, "isbn": "1"})
    opened = closed({"type": "object", "properties": {"a": {}}, "additionalProperties": True})
    assert opened["additionalProperties"] is True
    extra = {"type": "object", "properties": {"a": {}}, "patternProperties": {"^x": {}}}
    assert "additionalProperties" not in closed(extra)


def test_objects_without_properties_and_allof_branches_stay_as_written() -> None:
    assert closed({"type": "object"}) == {"type": "object"}  # any object (json_object mode)
    branches = {"allOf": [{"properties": {"a": {"type": "string"}}},
                          {"properties": {"b": {"type": "string"}}}]}  # fmt: skip
    read = closed(branches)
    assert all("additionalProperties" not in b for b in read["allOf"])
    assert jsonschema.Draft202012Validator(read).is_valid({"a": "x", "b": "y"})


def test_integers_without_bounds_are_held_to_the_exact_json_range() -> None:
    read = closed({"type": "array", "items": {"type": "integer"}})
    assert read["items"] == {"type": "integer", "minimum": -SAFE_INTEGER, "maximum": SAFE_INTEGER}
    kept = closed({"type": "integer", "minimum": 0, "exclusiveMaximum": 10})
    assert kept == {"type": "integer", "minimum": 0, "exclusiveMaximum": 10}
    either = closed({"anyOf": [{"type": "integer"}, {"type": "string"}]})
    assert either["anyOf"][0]["maximum"] == SAFE_INTEGER


def test_strict_requires_every_property() -> None:
    read = closed(Book.model_json_schema(), strict=True)
    assert read["required"] == ["title", "authors"]
    assert read["$defs"]["Author"]["required"] == ["name", "born"]
    assert not jsonschema.Draft202012Validator(read).is_valid(
        {"title": "T", "authors": [{"name": "A"}]}
    )
    assert closed(Book.model_json_schema())["$defs"]["Author"]["required"] == ["name"]


def guide_schema(body: dict[str, Any]) -> dict[str, Any]:
    """The schema the engine is given for a chat request ``body``."""
    request = ChatCompletionRequest.model_validate(
        {"model": "m", "messages": [{"role": "user", "content": "hi"}], **body}
    )
    guide = request.to_sampling_params().guide
    assert guide is not None and guide.kind == "json"
    return json.loads(guide.source)  # type: ignore[no-any-return]


@pytest.mark.parametrize("strict", [False, True])
def test_the_rules_reach_the_engine_from_response_format_and_guided_json(strict: bool) -> None:
    schema = Author.model_json_schema()
    fmt = {"type": "json_schema", "json_schema": {"name": "a", "schema": schema, "strict": strict}}
    read = guide_schema({"response_format": fmt})
    assert read["additionalProperties"] is False
    assert read["required"] == (["name", "born"] if strict else ["name"])
    assert guide_schema({"guided_json": json.dumps(schema)})["additionalProperties"] is False


def test_a_tools_parameters_are_read_alike_in_the_calls_grammar() -> None:
    def grammar(strict: bool | None) -> str:
        tool = {
            "type": "function",
            "function": {
                "name": "add_book",
                "parameters": Book.model_json_schema(),
                "strict": strict,
            },
        }
        request = ChatCompletionRequest.model_validate({
            "model": "m", "messages": [{"role": "user", "content": "hi"}], "tools": [tool],
            "tool_choice": "required"})  # fmt: skip
        guide = request.tool_use(None).guide
        assert guide is not None and guide.kind == "grammar"
        return guide.source

    loose, strict = grammar(None), grammar(True)
    want = closed(Book.model_json_schema(), strict=True)
    assert json.dumps(want["$defs"], ensure_ascii=False) in strict
    assert json.dumps(closed(Book.model_json_schema())["$defs"], ensure_ascii=False) in loose
    assert '"additionalProperties": false' in loose
