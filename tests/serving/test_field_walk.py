"""Every field of OpenAI's chat and completions requests, walked one by one with a value that
asks for something: the server implements it (the request parses and maps to sampling
parameters) or refuses it with a 400 whose ``param`` names it. Nothing is dropped silently.

The lists are OpenAI's API reference's request bodies (chat completions and legacy
completions, as of late 2025)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from kunlun.errors import RequestError
from kunlun.protocol.fields import IGNORED_FIELDS
from kunlun.protocol.openai_api import ChatCompletionRequest, CompletionRequest
from kunlun.protocol.openai_errors import error_status_and_body
from kunlun.protocol.request_body import parse_request

TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
CHAT_FIELDS: dict[str, Any] = {
    "audio": {"voice": "alloy", "format": "mp3"},
    "frequency_penalty": 0.5,
    "function_call": {"name": "f"},
    "functions": [{"name": "f"}],
    "logit_bias": {"50": -100},
    "logprobs": True,
    "max_completion_tokens": 5,
    "max_tokens": 5,
    "metadata": {"k": "v"},
    "modalities": ["text", "audio"],
    "n": 2,
    "parallel_tool_calls": False,
    "prediction": {"type": "content", "content": "x"},
    "presence_penalty": 0.5,
    "prompt_cache_key": "k",
    "reasoning_effort": "low",
    "response_format": {"type": "json_object"},
    "safety_identifier": "s",
    "seed": 1,
    "service_tier": "auto",
    "stop": ["x"],
    "store": True,
    "stream": True,
    "stream_options": {"include_usage": True},
    "temperature": 0.5,
    "tool_choice": "required",
    "tools": [TOOL],
    "top_logprobs": 2,
    "top_p": 0.5,
    "user": "u",
    "verbosity": "low",
    "web_search_options": {},
}
COMPLETION_FIELDS: dict[str, Any] = {
    "best_of": 2,
    "echo": True,
    "frequency_penalty": 0.5,
    "logit_bias": {"50": -100},
    "logprobs": 2,
    "max_tokens": 5,
    "n": 2,
    "presence_penalty": 0.5,
    "seed": 1,
    "stop": "x",
    "stream": True,
    "stream_options": {"include_usage": True},
    "suffix": "end",
    "temperature": 0.5,
    "top_p": 0.5,
    "user": "u",
}
ASKS_NOTHING = {"web_search_options"}
"""Fields whose sample value asks for nothing (``{}``): accepted as if absent."""


def outcome(model: type[ChatCompletionRequest | CompletionRequest], body: dict[str, Any],
            field: str) -> str:  # fmt: skip
    """``implemented``, ``ignored`` or ``refused`` (a 400 naming ``field``)."""
    try:
        request = parse_request(model, json.dumps(body).encode())
        if field == "top_logprobs":
            request = parse_request(model, json.dumps({**body, "logprobs": True}).encode())
        request.to_sampling_params()
    except RequestError as exc:
        status, error, _ = error_status_and_body(exc)
        assert status == 400 and error["error"]["param"] == field, (field, error)
        assert field in error["error"]["message"], (field, error)
        return "refused"
    return "ignored" if field in IGNORED_FIELDS or field in ASKS_NOTHING else "implemented"


@pytest.mark.parametrize("field", sorted(CHAT_FIELDS))
def test_every_chat_field_is_implemented_or_refused_by_name(field: str) -> None:
    body = {
        "model": "m",
        "messages": [{"role": "user", "content": "hi"}],
        field: CHAT_FIELDS[field],
    }
    assert outcome(ChatCompletionRequest, body, field) in ("implemented", "ignored", "refused")


@pytest.mark.parametrize("field", sorted(COMPLETION_FIELDS))
def test_every_completion_field_is_implemented_or_refused_by_name(field: str) -> None:
    body = {"model": "m", "prompt": "hi", field: COMPLETION_FIELDS[field]}
    assert outcome(CompletionRequest, body, field) in ("implemented", "ignored", "refused")


def test_the_walk_knows_which_are_refused() -> None:
    """The outcome of each field is as documented (docs/openai-api.md)."""
    chat = {f: outcome(ChatCompletionRequest, {"model": "m", "messages": [
        {"role": "user", "content": "hi"}], f: v}, f) for f, v in CHAT_FIELDS.items()}  # fmt: skip
    refused = sorted(f for f, how in chat.items() if how == "refused")
    assert refused == ["audio", "function_call", "functions", "logit_bias", "modalities",
                       "prediction", "reasoning_effort", "verbosity"]  # fmt: skip
    assert chat["response_format"] == "implemented" and chat["metadata"] == "ignored"
