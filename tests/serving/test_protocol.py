"""OpenAI request models, their sampling parameters, the error mapping and logprob shapes."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from kunlun.errors import EngineError, Location, PromptTooLong, RequestError
from kunlun.protocol import responses, sse
from kunlun.protocol.openai_api import ChatCompletionRequest, CompletionRequest
from kunlun.protocol.openai_errors import (
    AuthenticationError,
    ModelNotFound,
    QueueFull,
    ServiceUnavailable,
    WorkerDied,
    error_status_and_body,
)
from kunlun.protocol.request_body import parse_request
from kunlun.protocol.schemas import closed

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


def chat(**fields: object) -> ChatCompletionRequest:
    return parse_request(ChatCompletionRequest, json.dumps({**CHAT, **fields}).encode())


def completion(**fields: object) -> CompletionRequest:
    body = {"model": "m", "prompt": "hi", **fields}
    return parse_request(CompletionRequest, json.dumps(body).encode())


def test_chat_maps_to_sampling_params() -> None:
    params = chat(
        max_tokens=5, max_completion_tokens=7, temperature=0, stop="\n", seed=3, n=2,
        logprobs=True, top_logprobs=4, top_k=10, ignore_eos=True,
    ).to_sampling_params()  # fmt: skip
    assert (params.max_tokens, params.temperature, params.stop, params.seed) == (7, 0, ["\n"], 3)
    assert (params.n, params.logprobs, params.top_k, params.ignore_eos) == (2, 4, 10, True)
    assert params.prompt_logprobs is None
    defaults = chat().to_sampling_params()
    assert (defaults.temperature, defaults.top_p, defaults.logprobs) == (1.0, 1.0, None)
    assert chat(logprobs=True).to_sampling_params().logprobs == 0


@pytest.mark.parametrize(
    ("fields", "param", "text"),
    [
        ({"tools": [{"type": "function", "function": {"name": "f g"}}]},
         "tools.0.function.name", "pattern"),
        ({"tool_choice": "sometimes"}, "tool_choice", "tool_choice"),
        ({"response_format": {"type": "xml"}}, "response_format.type", "json_schema"),
        ({"logit_bias": {"50256": -100}}, "logit_bias", "logit bias"),
        ({"functions": [{"name": "f"}]}, "functions", "deprecated form of tools"),
        ({"temprature": 0.5}, "temprature", "unknown field 'temprature'"),
        ({"stream": True, "stream_options": {"include_usage": True, "x": 1}},
         "stream_options.x", "unknown field"),
        ({"messages": [{"role": "assistant", "content": "a", "tool_calls": [{"id": "c"}]}]},
         "messages.0.tool_calls.0.function", "Field required"),
        ({"messages": [{"role": "user", "content": [{"type": "text", "text": "a", "x": 1}]}]},
         "messages.0.content.0.x", "unknown field"),
    ],
)  # fmt: skip
def test_unimplemented_and_unknown_fields_are_refused_by_name(
    fields: dict[str, object], param: str, text: str
) -> None:
    with pytest.raises(RequestError) as caught:
        chat(**fields)
    status, body, _ = error_status_and_body(caught.value)
    assert (status, body["error"]["param"]) == (400, param)
    assert text in body["error"]["message"] and param in body["error"]["message"]


@pytest.mark.parametrize(
    ("fields", "param", "text"),
    [
        ({"response_format": {"type": "json_object"}, "guided_regex": "a+"}, "guided_regex",
         "use one of response_format, guided_regex"),
        ({"response_format": {"type": "json_schema"}}, "response_format.json_schema",
         "needs json_schema"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
         "response_format.json_schema.schema", "the schema is missing"),
        ({"guided_json": "{not json"}, "guided_json", "not valid JSON"),
    ],
)  # fmt: skip
def test_conflicting_or_incomplete_constraints_are_refused_by_name(
    fields: dict[str, object], param: str, text: str
) -> None:
    with pytest.raises(RequestError) as caught:
        chat(**fields).to_sampling_params()
    status, body, _ = error_status_and_body(caught.value)
    assert (status, body["error"]["param"]) == (400, param)
    assert text in body["error"]["message"]


def test_constraints_become_the_engine_guide() -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": True}}
    guide = chat(response_format=fmt).to_sampling_params().guide
    assert guide is not None and (guide.kind, json.loads(guide.source)) == (
        "json",
        closed(schema, strict=True),
    )  # read as kunlun.protocol.schemas says (tests/serving/test_schemas.py)
    guide = chat(response_format={"type": "json_object"}).to_sampling_params().guide
    assert guide is not None and json.loads(guide.source) == {"type": "object"}
    assert chat(response_format={"type": "text"}).to_sampling_params().guide is None
    guide = completion(guided_choice=["a", "b"]).to_sampling_params().guide
    assert guide is not None and (guide.kind, guide.field) == ("choice", "guided_choice")
    guide = completion(guided_regex="[0-9]+").to_sampling_params().guide
    assert guide is not None and (guide.kind, guide.source) == ("regex", "[0-9]+")


def test_completion_only_fields_are_refused_by_name() -> None:
    for fields, param in (({"best_of": 3}, "best_of"), ({"suffix": "end"}, "suffix")):
        with pytest.raises(RequestError) as caught:
            completion(**fields)
        assert caught.value.location == Location("request", field=param)


def test_ignored_fields_and_unsupported_ones_that_ask_for_nothing_are_accepted() -> None:
    request = chat(
        user="u1", metadata={"k": "v"}, store=False, service_tier="auto", safety_identifier="s",
        prompt_cache_key="p", parallel_tool_calls=True, tools=[], tool_choice="none",
        functions=None, response_format={"type": "text"}, logit_bias={}, stream=True,
        stream_options={"include_usage": True, "include_obfuscation": False},
        messages=[{"role": "assistant", "content": "a", "tool_calls": [], "refusal": None}],
    )  # fmt: skip
    assert request.include_usage and request.to_sampling_params().n == 1
    assert completion(best_of=1, suffix=None, user="u").prompts() == ["hi"]


def test_the_documented_lists_of_fields_are_disjoint_and_in_the_docs() -> None:
    from pathlib import Path

    from kunlun.protocol.fields import IGNORED_FIELDS, UNSUPPORTED_FIELDS

    assert not IGNORED_FIELDS.keys() & UNSUPPORTED_FIELDS.keys()
    doc = (Path(__file__).parents[2] / "docs" / "openai-api.md").read_text()
    section = doc.split("# The OpenAI API", 1)[1].split("\n## ", 1)[0]
    for name in (*IGNORED_FIELDS, *UNSUPPORTED_FIELDS):
        assert f"`{name}`" in section, name


def test_chat_content_parts_and_roles() -> None:
    request = chat(messages=[
        {"role": "developer", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
    ])  # fmt: skip
    assert [m.template_dict() for m in request.messages] == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "ab"},
    ]
    image = chat(messages=[{"role": "user", "content": [{"type": "image_url"}]}])
    with pytest.raises(RequestError, match="image_url"):
        image.messages[0].template_dict()


def test_completion_prompts_echo_and_logprobs() -> None:
    assert completion().prompts() == ["hi"]
    assert completion(prompt=["a", "b"]).prompts() == ["a", "b"]
    assert completion(prompt=[1, 2]).prompts() == [[1, 2]]
    assert completion(prompt=[[1], [2, 3]]).prompts() == [[1], [2, 3]]
    params = completion(echo=True, logprobs=2).to_sampling_params()
    assert (params.logprobs, params.prompt_logprobs, params.max_tokens) == (2, 2, 16)
    assert completion(logprobs=2).to_sampling_params().prompt_logprobs is None
    with pytest.raises(RequestError, match="empty"):
        completion(prompt=[]).prompts()


@pytest.mark.parametrize(
    ("fields", "param", "text"),
    [
        ({"temperature": -1}, "temperature", "temperature=-1 is invalid"),
        ({"top_logprobs": 3}, "top_logprobs", "needs logprobs=true"),
        ({"top_logprobs": 21, "logprobs": True}, "top_logprobs", "less than or equal to 20"),
        ({"n": 0}, "n", "n=0"),
        ({"stop": [""]}, "stop", "must not be empty"),
        ({"stop": 5}, "stop", "a string or a list of strings"),
        ({"messages": [{"role": "robot", "content": "x"}]}, "messages.0.role", "robot"),
        ({"messages": []}, "messages", "at least 1"),
        ({"model": None}, "model", "model=None"),
    ],
)
def test_bad_chat_fields_name_the_field(fields: dict[str, object], param: str, text: str) -> None:
    with pytest.raises(RequestError) as caught:
        chat(**fields).to_sampling_params()
    status, body, _ = error_status_and_body(caught.value)
    assert status == 400 and body["error"]["param"] == param
    assert text in body["error"]["message"]
    assert body["error"]["type"] == "invalid_request_error"


def test_completion_logprobs_limit_and_bad_json() -> None:
    with pytest.raises(RequestError, match="logprobs=6"):
        completion(logprobs=6)
    with pytest.raises(RequestError, match="not valid JSON"):
        parse_request(CompletionRequest, b"{nope")


@pytest.mark.parametrize(
    ("error", "status", "kind", "code"),
    [
        (RequestError("bad"), 400, "invalid_request_error", "request.invalid"),
        (PromptTooLong("long"), 400, "invalid_request_error", "context_length_exceeded"),
        (AuthenticationError("key"), 401, "authentication_error", "invalid_api_key"),
        (ModelNotFound("which"), 404, "invalid_request_error", "model_not_found"),
        (QueueFull("busy", retry_after_s=2), 429, "rate_limit_error", "rate_limit_exceeded"),
        (ServiceUnavailable("later"), 503, "service_unavailable_error", "service_unavailable"),
        (WorkerDied("gone"), 502, "server_error", "worker_died"),
        (EngineError("step failed"), 500, "server_error", "engine.error"),
        (ValueError("bug"), 500, "server_error", "kunlun.error"),
    ],
)
def test_error_mapping(error: Exception, status: int, kind: str, code: str) -> None:
    got_status, body, headers = error_status_and_body(error)
    assert (got_status, body["error"]["type"], body["error"]["code"]) == (status, kind, code)
    assert set(body["error"]) == {"message", "type", "param", "code"}
    if isinstance(error, QueueFull | ServiceUnavailable):
        assert headers["Retry-After"] == str(error.retry_after_s)
    else:
        assert headers == {}


def test_error_message_keeps_location_and_hint() -> None:
    error = RequestError("no", location=Location("spec.yaml", 3, "model"), hint="fix it")
    body = error_status_and_body(error)[1]["error"]
    assert body["message"] == "spec.yaml:3 (model): no (hint: fix it)"
    assert body["param"] == "model"
    event = sse.error_event(WorkerDied("gone"))
    assert event.startswith(b"data: {") and event.endswith(b"\n\n")
    assert json.loads(event[6:])["error"]["code"] == "worker_died"


@pytest.mark.parametrize(
    ("data", "whole"),
    [(b"", 0), (b"data: {", 0), (b"data: 1\n\n", 9), (b"data: 1\n\ndata: {", 9),
     (b"data: 1\r\n\r\ndata: 2\r\n", 11), (b"data: 1\n\ndata: 2\n\n", 18)],
)  # fmt: skip
def test_whole_events_ends_at_the_last_blank_line(data: bytes, whole: int) -> None:
    assert sse.whole_events(data) == whole


class _Tokens:
    """Token text by id, for shape tests."""

    def __call__(self, token_id: int) -> tuple[str, list[int]]:
        text = f"t{token_id}"
        return text, list(text.encode())


def test_chat_logprobs_shape() -> None:
    entries = [{5: -0.5, 6: -1.5, 7: -math.inf}]
    result = responses.chat_logprobs(_Tokens(), [5], entries, 2)  # type: ignore[arg-type]
    (entry,) = result["content"]
    assert entry["token"] == "t5" and entry["logprob"] == -0.5 and entry["bytes"] == [116, 53]
    assert [t["token"] for t in entry["top_logprobs"]] == ["t5", "t6"]
    floor = responses.chat_logprobs(_Tokens(), [7], [entries[0]], 0)  # type: ignore[arg-type]
    assert floor["content"][0]["logprob"] == -9999.0 and floor["content"][0]["top_logprobs"] == []


def test_completion_logprobs_shape_with_echo() -> None:
    entries = [None, {2: -1.0, 3: -0.1}, {4: -0.2}]
    result = responses.completion_logprobs(_Tokens(), [1, 2, 4], entries, 1)  # type: ignore[arg-type]
    assert result["tokens"] == ["t1", "t2", "t4"]
    assert result["token_logprobs"] == [None, -1.0, -0.2]
    assert result["top_logprobs"] == [None, {"t3": -0.1}, {"t4": -0.2}]
    assert result["text_offset"] == [0, 2, 4]


def test_token_bytes_of_byte_level_vocabulary(demo_model_dir: Path) -> None:
    from kunlun.engine.tokenizer import Tokenizer

    tokenizer = Tokenizer(demo_model_dir)
    tokens = responses.TokenText(tokenizer)
    for text in (" Paris", "é", "\n"):
        (token_id,) = tokenizer.encode(text, add_special_tokens=False)[:1]
        token, data = tokens(token_id)
        assert bytes(data).decode() == token == tokenizer.decode([token_id])
    (euro,) = tokenizer.encode("€", add_special_tokens=False)[:1]
    assert bytes(tokens(euro)[1]) == "€".encode()[: len(tokens(euro)[1])]
