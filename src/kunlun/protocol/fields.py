"""Request fields: which the OpenAI API has and this server refuses, and which it accepts
and deliberately ignores.

Nothing a client sends is dropped silently. Every request model derives from
:class:`StrictModel`, which forbids fields it does not declare: a field this server does not
implement (:data:`UNSUPPORTED_FIELDS`) is a 400 naming it and what it is for, so a client
learns at once that it does not get what it asked; any other undeclared field
is unknown (a typo) and a 400 naming it too. An unsupported field whose value asks for
nothing (``null``, ``[]``, ``{}``, ``function_call: "none"``...) is accepted as if absent. The
fields accepted and ignored on purpose are declared on the models and listed here with the
reason (:data:`IGNORED_FIELDS`); docs/openai-api.md shows both lists.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, model_validator

UNSUPPORTED_FIELDS: dict[str, str] = {
    "functions": "the deprecated form of tools (send tools and tool_choice)",
    "function_call": "the deprecated form of tool_choice (send tools and tool_choice)",
    "logit_bias": "logit bias",
    "best_of": "best-of sampling",
    "suffix": "text insertion after the completion",
    "prediction": "predicted outputs",
    "audio": "audio output",
    "modalities": "output modalities other than text",
    "reasoning_effort": "reasoning models",
    "verbosity": "answer length control of reasoning models",
    "web_search_options": "web search",
    "refusal": "refusal messages",
    "reasoning": "reasoning models' settings",
    "background": "background responses",
    "include": "extra output (logprobs, reasoning) in responses",
    "conversation": "stored conversations",
}
"""OpenAI fields this server does not implement, and what they are for: a request that
uses one gets a 400 naming it (a value that asks for nothing is accepted: see
:func:`asks_nothing`)."""

IGNORED_FIELDS: dict[str, str] = {
    "user": "an end-user id for the provider's abuse monitoring; not recorded",
    "safety_identifier": "an end-user id for the provider's abuse monitoring; not recorded",
    "metadata": "tags for stored completions; nothing is stored",
    "store": "asks the provider to store the completion; nothing is stored",
    "service_tier": "there is one processing tier",
    "prompt_cache_key": "prefix caching is automatic",
    "stream_options.include_obfuscation": "no obfuscation padding is added to chunks",
    "response_format.json_schema.description": "the schema constrains the answer; its "
    "description is not shown to the model",
}
"""Fields accepted and deliberately ignored (they do not change the answer), and why."""

NEUTRAL: dict[str, tuple[Any, ...]] = {
    "function_call": ("none", "auto"),
    "best_of": (1,),
    "modalities": (["text"],),
    "n": (1,),
    "echo": (False,),
    "continuous_usage_stats": (False,),
}
"""Values of request fields that ask for what their absence asks for. The one table: the
gateway drops such a field where Kunlun does not support it, and an external engine's adapter
where that engine lacks it (:mod:`kunlun.engines.builtin`)."""


def asks_nothing(field: str, value: Any) -> bool:
    """Whether a field's ``value`` asks for nothing (absent in effect)."""
    return (
        value is None
        or value == []
        or value == {}
        or value == ""
        or (value in NEUTRAL.get(field, ()))
    )


def _without_neutral(data: Any) -> Any:
    """A request object without the unsupported fields whose values ask for nothing."""
    if isinstance(data, dict) and not UNSUPPORTED_FIELDS.keys().isdisjoint(data):
        return {
            k: v for k, v in data.items() if not (k in UNSUPPORTED_FIELDS and asks_nothing(k, v))
        }
    return data


class StrictModel(BaseModel):
    """A request object: unknown and unsupported fields are errors (``extra_forbidden``,
    which :func:`~kunlun.protocol.request_body.parse_request` words with
    :func:`extra_field_message`), unsupported ones that ask for nothing are dropped."""

    model_config = ConfigDict(extra="forbid")

    @model_validator(mode="before")
    @classmethod
    def _drop_neutral(cls, data: Any) -> Any:
        return _without_neutral(data)


def extra_field_message(field: str) -> str:
    """The error message for ``field`` (a dotted path), which no request model declares."""
    name = field.rsplit(".", 1)[-1]
    purpose = UNSUPPORTED_FIELDS.get(name)
    if purpose is not None:
        return (
            f"'{field}' is not supported by this server ({purpose} is not implemented); "
            "remove it, or send null"
        )
    return (
        f"unknown field '{field}'; check its spelling (the fields accepted are listed in "
        "docs/openai-api.md)"
    )
