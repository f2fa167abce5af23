"""Request-as-a-Service endpoints: a JSON-in, JSON-out API made of a model, two JSON Schemas
and a prompt template.

An endpoint (:class:`~kunlun.state.store.EndpointRecord`) is checked whole when it is made
(:func:`check_definition`): the name is a safe identifier, both schemas pass their
metaschema (the draft their ``$schema`` names, else 2020-12) and refer only inside
themselves (nothing is fetched), the output schema compiles for guided decoding
(:func:`check_guided`, where llguidance is installed), the prompt is a jinja2 template that
parses in the same sandbox as chat templates (:mod:`kunlun.jinja_sandbox`), and the model
name is not empty. Each error names the field and, when the checker is given the files the
fields came from (the CLI), the file and line.

Each call (:mod:`kunlun.daemon.endpoints_api`) validates its body against the input schema
(:func:`check_input`: a 400 whose ``param`` is the JSON path of the failing value, under
``input``), renders the prompt with ``input`` bound to the body (:func:`render_prompt`),
asks the model for a chat completion held to the output schema, and reads the answer back
(:func:`read_answer`): an answer cut by ``max_tokens`` or one that does not parse or validate
is a 502 naming the cause, never passed on. :func:`openapi_document` describes one endpoint
as an OpenAPI 3.1 document.
"""

from __future__ import annotations

import functools
import json
import math
import re
import warnings
from collections.abc import Iterable, Mapping
from typing import Any

import jinja2
import jsonschema
import jsonschema_rs
from jsonschema.protocols import Validator

from kunlun import budgets
from kunlun.errors import KunlunError, Location, RequestError
from kunlun.jinja_sandbox import sandbox_environment
from kunlun.state.store import EndpointRecord

NAME_RE = re.compile(r"[A-Za-z][A-Za-z0-9_-]{0,63}")
"""An endpoint name: a letter, then up to 63 letters, digits, ``_`` or ``-`` (a URL path
segment and a store key as it is)."""
FIELDS = ("name", "model", "input_schema", "output_schema", "prompt", "description")
"""What a definition holds (``POST /api/v1/endpoints`` takes these and ``replace``)."""
CALL_PARAMS = {"max_tokens": int, "temperature": float, "seed": int}
"""Generation controls a call may pass as query parameters (the body is the input alone)."""
PREFIX = "/v1/endpoints/"


class EndpointNotFound(RequestError):
    """No endpoint has the name a request names."""

    code = "endpoint_not_found"
    http_status = 404
    openai_type = "invalid_request_error"
    exit_code = 2


class EndpointExists(RequestError):
    """``create`` of a name that is taken, without ``replace``."""

    code = "endpoint_exists"
    http_status = 409
    openai_type = "invalid_request_error"
    exit_code = 2


class OutputInvalid(KunlunError):
    """The model's answer does not parse as JSON or does not validate against the output
    schema: the endpoint has no answer to give (a bad gateway, not a bad request)."""

    code = "endpoint_output_invalid"
    http_status = 502
    openai_type = "server_error"


class OutputTruncated(OutputInvalid):
    """Generation stopped at ``max_tokens`` before the JSON was complete."""

    code = "endpoint_output_truncated"


def check_definition(
    body: Mapping[str, Any], sources: Mapping[str, str] | None = None, now: float = 0.0
) -> EndpointRecord:
    """The endpoint ``body`` defines, checked; a :class:`RequestError` naming the field (in
    ``sources[field]``, a file, when given) otherwise. Unknown fields are refused."""
    unknown = sorted(set(body) - set(FIELDS))
    if unknown:
        raise _bad(sources, unknown[0], f"unknown field; an endpoint has {', '.join(FIELDS)}")
    name = body.get("name")
    if not isinstance(name, str) or not NAME_RE.fullmatch(name):
        raise _bad(sources, "name", f"must be a letter then up to 63 letters, digits, '_' or "
                   f"'-', got {name!r:.80}")  # fmt: skip
    model = body.get("model")
    if not isinstance(model, str) or not model.strip():
        raise _bad(sources, "model", f"must name the model to run, got {model!r:.80}")
    description = body.get("description") or ""
    if not isinstance(description, str):
        raise _bad(sources, "description", "must be a string")
    schemas = [check_schema(body.get(f), f, sources) for f in ("input_schema", "output_schema")]
    prompt = body.get("prompt")
    if not isinstance(prompt, str) or not prompt.strip():
        raise _bad(sources, "prompt", "must be a non-empty jinja2 template")
    compile_prompt(prompt, sources)
    return EndpointRecord(name, model.strip(), schemas[0], schemas[1], prompt, description,
                          now, now)  # fmt: skip


def check_schema(
    schema: Any, field: str, sources: Mapping[str, str] | None = None
) -> dict[str, Any] | bool:
    """``schema`` when it is a JSON Schema its metaschema accepts, referring only within
    itself; else a :class:`RequestError` naming ``field`` and the path inside it."""
    if not isinstance(schema, dict | bool):
        raise _bad(sources, field, f"must be a JSON Schema (an object), got {_kind(schema)}")
    if isinstance(schema, dict) and not isinstance(schema.get("$schema", ""), str):
        raise _bad(sources, f"{field}.$schema", "must be the URI of a JSON Schema draft")
    text = json.dumps(schema, sort_keys=True)
    if len(text) > budgets.limit("schema_bytes"):
        raise budgets.over(
            "schema_bytes", field, len(text), where=_bad(sources, field, "").location
        )
    try:
        with warnings.catch_warnings():  # re's FutureWarnings about a pattern: not for users
            warnings.simplefilter("ignore")
            _validator_class(schema).check_schema(schema)
    except jsonschema.SchemaError as exc:
        raise _bad(sources, _path(field, exc.absolute_path), exc.message) from None
    for where, ref in _refs(schema, ()):
        if not ref.startswith("#"):
            raise _bad(sources, _path(field, where), f"$ref {ref!r} points outside the schema; "
                       "only local references (#/...) are followed")  # fmt: skip
        if ref.startswith("#/") and not _resolves(schema, ref[2:].split("/")):
            raise _bad(sources, _path(field, where), f"$ref {ref!r} points at nothing")
    try:
        _validator(text)
    except jsonschema_rs.ValidationError as exc:
        at = _path(field, exc.instance_path)
        problem = exc.message.splitlines()[0] if exc.message else "cannot be compiled"
        if "regex" in problem:
            problem = (f"{problem}: a pattern must be a regular expression the linear-time "
                       "matcher takes (no look-around or back-references, at most "
                       f"{budgets.limit('regex_program_bytes'):,g} bytes compiled)")  # fmt: skip
        raise _bad(sources, at, _preview_message(problem)) from None
    return schema


def check_guided(schema: dict[str, Any] | bool, field: str = "output_schema") -> bool:
    """Compile ``schema`` for guided decoding as the engine will (llguidance); a
    :class:`RequestError` naming ``field`` when it cannot. False when llguidance is not
    installed here (the engine's worker then checks it at the first call)."""
    try:
        import llguidance
    except ImportError:
        return False
    try:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema))
        problem = llguidance.LLMatcher.validate_grammar(grammar)
    except Exception as exc:  # noqa: BLE001 - whatever the compiler raises is the answer
        problem = str(exc) or type(exc).__name__
    except BaseException as exc:  # a Rust panic (pyo3's PanicException) is no Exception
        if type(exc).__name__ != "PanicException":
            raise
        problem = f"the grammar compiler failed on it ({exc})"
    if problem:
        raise _bad(None, field, f"cannot be used for guided decoding: {problem}")
    return True


def compile_prompt(text: str, sources: Mapping[str, str] | None = None) -> jinja2.Template:
    """The prompt template, compiled in the sandbox; a :class:`RequestError` naming the line."""
    try:
        return _template(text)
    except jinja2.TemplateSyntaxError as exc:
        raise _bad(sources, "prompt", f"not a valid jinja2 template: {exc.message}",
                   exc.lineno) from None  # fmt: skip


def check_input(record: EndpointRecord, body: Any) -> None:
    """A 400 whose ``param`` is the path of the first failing value (``input.items.2.price``).
    Linear in the body and the schema (patterns run on a matcher without backtracking), yet
    the daemon calls it off the event loop within the program budget."""
    validator = _validator(json.dumps(record.input_schema, sort_keys=True))
    error = next(validator.iter_errors(body), None)
    if error is not None:
        where = _path("input", error.instance_path)
        raise RequestError(f"{where}: {_error_text(error)}",
                           location=Location("request", field=where))  # fmt: skip


def render_prompt(record: EndpointRecord, body: Any) -> str:
    """The user message: the template rendered with ``input`` (the validated body),
    ``endpoint`` (the name) and ``output_schema`` bound."""
    try:
        return _template(record.prompt).render(input=body, endpoint=record.name,
                                               output_schema=record.output_schema)  # fmt: skip
    except jinja2.TemplateError as exc:
        raise RequestError(
            f"endpoint {record.name!r}'s prompt template failed on this input: {exc}",
            location=Location("request", field="input"),
        ) from None


def chat_request(record: EndpointRecord, prompt: str, params: Mapping[str, Any]) -> bytes:
    """The chat completion body that asks ``record.model`` for the output."""
    body: dict[str, Any] = {
        "model": record.model,
        "messages": [{"role": "user", "content": prompt}],
        "response_format": {"type": "json_schema",
                            "json_schema": {"name": record.name, "schema": record.output_schema}},
        "temperature": 0.0,
        **params,
    }  # fmt: skip
    return json.dumps(body, ensure_ascii=False).encode()


def call_params(query: Iterable[tuple[str, str]]) -> dict[str, Any]:
    """The generation controls of a call's query string (:data:`CALL_PARAMS`); an unknown
    or malformed one is a 400 naming it."""
    params: dict[str, Any] = {}
    for key, raw in query:
        kind = CALL_PARAMS.get(key)
        if kind is None:
            raise RequestError(f"unknown query parameter {key!r}; a call takes "
                               f"{', '.join(CALL_PARAMS)} (the body is the input)",
                               location=Location("request", field=key))  # fmt: skip
        try:
            params[key] = kind(raw)
            if not math.isfinite(params[key]):
                raise ValueError(raw)
        except ValueError:
            raise RequestError(f"{key} must be {'an integer' if kind is int else 'a number'}, "
                               f"got {raw!r:.40}", location=Location("request", field=key)) from None  # fmt: skip
    return params


def read_answer(record: EndpointRecord, answer: Mapping[str, Any]) -> dict[str, Any]:
    """The endpoint's reply to a chat completion ``answer`` (parsed and validated), or
    :class:`OutputInvalid` saying why there is none."""
    choice = answer["choices"][0]
    text = choice["message"].get("content") or ""
    finish = choice.get("finish_reason")
    usage = answer.get("usage") or {}
    if finish == "length":
        raise OutputTruncated(
            f"the model stopped at max_tokens ({usage.get('completion_tokens')} tokens) before "
            f"its JSON was complete: {_preview(text)}",
            hint="raise ?max_tokens=, or bound the output schema (maxLength, maxItems, enum)",
        )
    try:
        output = json.loads(text)
    except ValueError as exc:
        raise OutputInvalid(f"the model's answer is not JSON ({exc}): {_preview(text)}") from None
    validator = _validator(json.dumps(record.output_schema, sort_keys=True))
    error = next(validator.iter_errors(output), None)
    if error is not None:
        raise OutputInvalid(f"the model's answer does not match the output schema at "
                            f"{_path('output', error.instance_path)}: "
                            f"{_error_text(error)}")  # fmt: skip
    return {"output": output, "endpoint": record.name, "model": record.model,
            "id": answer.get("id"), "finish_reason": finish, "usage": usage}  # fmt: skip


def describe(record: EndpointRecord, base_url: str) -> dict[str, Any]:
    """An entry of ``GET /v1/endpoints``."""
    url = f"{base_url.rstrip('/')}{PREFIX}{record.name}"
    return {"name": record.name, "object": "endpoint", "model": record.model,
            "description": record.description, "created": int(record.created), "url": url,
            "openapi": f"{url}/openapi.json"}  # fmt: skip


def openapi_document(record: EndpointRecord, base_url: str) -> dict[str, Any]:
    """An OpenAPI 3.1 document of ``POST /v1/endpoints/<name>``: the request body is the
    input schema, the 200 answer the reply around the output schema. Both schemas sit in
    ``components.schemas`` (their local ``$ref``\\s rewritten to point there)."""
    name = record.name
    error = {"type": "object", "required": ["error"], "properties": {"error": {
        "type": "object", "properties": {"message": {"type": "string"},
        "type": {"type": "string"}, "param": {"type": ["string", "null"]},
        "code": {"type": ["string", "null"]}}}}}  # fmt: skip
    reply = {
        "type": "object",
        "required": ["output", "endpoint", "model", "finish_reason", "usage"],
        "properties": {
            "output": {"$ref": "#/components/schemas/Output"},
            "endpoint": {"const": name},
            "model": {"type": "string"},
            "id": {"type": ["string", "null"]},
            "finish_reason": {"type": "string"},
            "usage": {
                "type": "object",
                "required": ["prompt_tokens", "completion_tokens", "total_tokens"],
                "properties": {
                    k: {"type": "integer"}
                    for k in ("prompt_tokens", "completion_tokens", "total_tokens")
                },
            },  # fmt: skip
        },
    }

    def answer(text: str, ref: str) -> dict[str, Any]:
        return {"description": text,
                "content": {"application/json": {"schema": {"$ref": ref}}}}  # fmt: skip

    params = [{"name": key, "in": "query", "required": False,
               "schema": {"type": "integer" if kind is int else "number"}}
              for key, kind in CALL_PARAMS.items()]  # fmt: skip
    operation = {
        "operationId": f"call_{name.replace('-', '_')}",
        "summary": record.description or f"Run endpoint {name} on {record.model}",
        "parameters": params,
        "requestBody": answer("The input", "#/components/schemas/Input") | {"required": True},
        "responses": {
            "200": answer("The output, valid against the output schema",
                          "#/components/schemas/Reply"),
            "400": answer("The input does not match the input schema (param: its path)",
                          "#/components/schemas/Error"),
            "404": answer("No such endpoint", "#/components/schemas/Error"),
            "502": answer("The model gave no valid output", "#/components/schemas/Error"),
        },
    }  # fmt: skip
    return {
        "openapi": "3.1.0",
        "info": {
            "title": f"Kunlun endpoint {name}",
            "version": str(int(record.updated)),
            "description": record.description,
        },  # fmt: skip
        "servers": [{"url": base_url.rstrip("/")}],
        "paths": {f"{PREFIX}{name}": {"post": operation}},
        "components": {
            "schemas": {
                "Input": _rebase(record.input_schema, "#/components/schemas/Input"),
                "Output": _rebase(record.output_schema, "#/components/schemas/Output"),
                "Reply": reply,
                "Error": error,
            },
            "securitySchemes": {"apiKey": {"type": "http", "scheme": "bearer"}},
        },
    }


@functools.lru_cache(maxsize=256)
def _template(text: str) -> jinja2.Template:
    return sandbox_environment(keys_first=True).from_string(text)


@functools.lru_cache(maxsize=256)
def _validator(schema_text: str) -> Any:
    """The checker of values against a schema: jsonschema-rs, with the ``regex`` crate's
    linear-time matcher for ``pattern`` and ``patternProperties`` (a schema's ``^(a+)+$``
    cannot backtrack for ever) and nothing fetched (references are local, checked before)."""
    program = int(budgets.limit("regex_program_bytes"))
    return jsonschema_rs.validator_for(
        json.loads(schema_text),
        pattern_options=jsonschema_rs.RegexOptions(size_limit=program, dfa_size_limit=program),
        retriever=_no_retrieval,
    )


def _no_retrieval(uri: str) -> Any:
    raise ValueError(f"{uri!r} is not fetched: only local references (#/...) are followed")


def _error_text(error: Any) -> str:
    """A checker's error message with the value it quotes shortened (a 100 kB string is
    named by its first characters), then cut to 300 characters."""
    message = str(error.message)
    try:
        quoted = json.dumps(error.instance, separators=(",", ":"), ensure_ascii=False)
    except (TypeError, ValueError):
        quoted = ""
    if len(quoted) > 80:
        message = message.replace(quoted, f"{quoted[:60]}... ({len(quoted):,} characters)", 1)
    return _preview_message(message)


def _preview_message(message: str, limit: int = 300) -> str:
    """A checker's message, which quotes the value, cut to ``limit`` characters."""
    return message if len(message) <= limit else message[: limit - 3] + "..."


def _validator_class(schema: Any) -> type[Validator]:
    cls: type[Validator] = jsonschema.validators.validator_for(
        schema, default=jsonschema.Draft202012Validator
    )
    return cls


def _refs(node: Any, where: tuple[Any, ...]) -> Iterable[tuple[tuple[Any, ...], str]]:
    """Every ``$ref`` in ``node`` with its path."""
    if isinstance(node, dict):
        for key, value in node.items():
            if key == "$ref" and isinstance(value, str):
                yield (*where, key), value
            else:
                yield from _refs(value, (*where, key))
    elif isinstance(node, list):
        for index, value in enumerate(node):
            yield from _refs(value, (*where, index))


def _resolves(node: Any, parts: list[str]) -> bool:
    """Whether the JSON pointer ``parts`` (RFC 6901, unescaped here) names a value in ``node``."""
    for raw in parts:
        part = raw.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return False
    return True


def _rebase(node: Any, root: str) -> Any:
    """``node`` with each local ``$ref`` (``#...``) made relative to ``root`` instead."""
    if isinstance(node, dict):
        return {key: (root + value[1:]) if key == "$ref" and isinstance(value, str)
                and value.startswith("#") else _rebase(value, root)
                for key, value in node.items()}  # fmt: skip
    if isinstance(node, list):
        return [_rebase(value, root) for value in node]
    return node


def _path(head: str, parts: Iterable[Any]) -> str:
    return ".".join([head, *(str(p) for p in parts)])


def _bad(
    sources: Mapping[str, str] | None, field: str, message: str, line: int | None = None
) -> RequestError:
    """An error about ``field`` (``output_schema.properties.x``): in its file when
    ``sources`` names one for the top field, else in the request."""
    top = field.split(".", 1)[0]
    where = (sources or {}).get(top, "request")
    return RequestError(f"{field}: {message}" if where == "request" else message,
                        location=Location(where, line, field))  # fmt: skip


def _kind(value: Any) -> str:
    return "null" if value is None else type(value).__name__


def _preview(text: str, limit: int = 120) -> str:
    return repr(text) if len(text) <= limit else repr(text[:limit]) + "..."
