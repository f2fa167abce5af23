"""Reading a JSON request body into a pydantic model, and describing one for OpenAPI.

:func:`parse_request` is how every route that reads its body itself validates it (the OpenAI
requests of :mod:`kunlun.protocol.openai_api`, the embeddings and SGLang requests, the Batch
API's and the admin API's bodies): a bad body is one :class:`RequestError` naming the field
(``messages.0.content``), an unknown field one worded by
:func:`~kunlun.protocol.fields.extra_field_message`. :func:`openapi_body` documents such a
route's body in the app's OpenAPI schema.
"""

from __future__ import annotations

from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

from kunlun.errors import RequestError
from kunlun.protocol.fields import extra_field_message
from kunlun.protocol.openai_errors import param_error

_R = TypeVar("_R", bound=BaseModel)

_FORMS = {
    "prompt": "a string, a list of strings, a list of token ids or a list of such lists",
    "input": "a string, a list of strings, a list of token ids or a list of such lists",
    "stop": "a string or a list of strings",
    "content": "a string or a list of content parts",
}
"""What a union-typed field accepts, for errors that would otherwise name one member."""


def parse_request(model: type[_R], body: bytes) -> _R:
    """Validate a JSON body into ``model``; raise :class:`RequestError` naming the field."""
    try:
        return model.model_validate_json(body)
    except ValidationError as exc:
        errors = exc.errors(include_url=False)
        first = errors[0]
        if first["type"] == "json_invalid":
            raise RequestError(f"request body is not valid JSON: {first['msg']}") from None
        extra = next((e for e in errors if e["type"] == "extra_forbidden"), None)
        if extra is not None:  # before a union's other members' complaints
            name = ".".join(str(p) for p in extra["loc"] if not _is_tag(p))
            raise param_error(name, extra_field_message(name)) from None
        field, in_union = _field_path(first["loc"])
        if field is None:
            raise RequestError(f"request body is invalid: {first['msg']}") from None
        value = first.get("input")
        shown = "" if isinstance(value, dict | list) else f"={value!r}"
        reason = first["msg"]
        last = field.rsplit(".", 1)[-1]
        if in_union and last in _FORMS:
            reason = f"expected {_FORMS[last]}"
        raise param_error(field, f"{field}{shown} is invalid: {reason}") from None


def _field_path(loc: tuple[int | str, ...]) -> tuple[str | None, bool]:
    """``messages.0.content`` from a pydantic location, cut at the first union member tag
    (``str``, ``list[int]``...); and whether there was one."""
    parts: list[str] = []
    for part in loc:
        if _is_tag(part):
            return ".".join(parts) or None, True
        parts.append(str(part))
    return ".".join(parts) or None, False


_TAGS = {"str", "int", "float", "bool", "list", "dict", "none"}


def _is_tag(part: int | str) -> bool:
    """Whether a pydantic location part names a union member (``str``, ``list[int]``...)."""
    return isinstance(part, str) and (not part.isidentifier() or part in _TAGS)


def openapi_body(model: type[BaseModel]) -> dict[str, Any]:
    """An OpenAPI ``requestBody`` for ``model`` with every ``$ref`` inlined (for routes that
    read their body themselves, so the schema still documents it)."""
    schema = model.model_json_schema()
    definitions = schema.pop("$defs", {})

    def inline(node: Any) -> Any:
        if isinstance(node, dict):
            ref = node.get("$ref")
            if isinstance(ref, str) and ref.startswith("#/$defs/"):
                return inline(definitions[ref.removeprefix("#/$defs/")])
            return {key: inline(value) for key, value in node.items()}
        if isinstance(node, list):
            return [inline(item) for item in node]
        return node

    return {"required": True, "content": {"application/json": {"schema": inline(schema)}}}
