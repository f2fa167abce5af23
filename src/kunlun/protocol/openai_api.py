"""The OpenAI API as Kunlun serves it: the request models and their sampling mapping.

Requests are pydantic models (read with :func:`~kunlun.protocol.request_body.parse_request`)
that turn into one :class:`SamplingParams` with :meth:`to_sampling_params`. Nothing a client
sends is dropped silently: a field this server does not implement (``tools``,
``response_format``...) or does not know (a typo) is a 400 naming it; the fields accepted and
deliberately ignored are declared (:mod:`kunlun.protocol.fields` keeps both lists). The
errors, and the one mapping of an error to the OpenAI error shape, are in
:mod:`kunlun.protocol.openai_errors`.

Response bodies are built in :mod:`kunlun.protocol.responses`.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import Field

from kunlun import budgets, json_text
from kunlun.engine.guided import Guide
from kunlun.engine.sampling_params import SamplingParams
from kunlun.protocol.fields import StrictModel
from kunlun.protocol.openai_errors import param_error
from kunlun.protocol.schemas import closed
from kunlun.protocol.tools import MessageToolCall, ToolChoice, ToolDef, ToolUse

TokenIds = list[Annotated[int, Field(ge=0)]]


class StreamOptions(StrictModel):
    include_usage: bool = False
    """Send a last chunk with ``choices: []`` and the request's usage."""
    include_obfuscation: bool | None = None
    """Accepted, ignored (:data:`IGNORED_FIELDS`)."""
    continuous_usage_stats: bool = False
    """vLLM's: with ``include_usage``, every chunk also carries the usage so far."""


class JsonSchemaFormat(StrictModel):
    """``response_format.json_schema``: the schema the answer must validate against."""

    name: str
    schema_: Annotated[dict[str, Any] | None, Field(alias="schema")] = None
    description: str | None = None
    """Accepted, ignored (:data:`IGNORED_FIELDS`)."""
    strict: bool | None = None
    """With ``true``, every property of the schema is required (:mod:`kunlun.protocol.schemas`:
    the schema is enforced either way, its objects closed)."""


class StructuredOutputs(StrictModel):
    """vLLM's ``structured_outputs``: one constraint on the output, as its ``guided_*``
    fields say it (``json``, ``regex``, ``choice``, ``grammar``), or any JSON object."""

    json_: Annotated[dict[str, Any] | str | None, Field(alias="json")] = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None

    def given(self) -> list[str]:
        names = ("json", "regex", "choice", "grammar")
        given = [n for n in names if getattr(self, n + "_" * (n == "json")) is not None]
        return given + (["json_object"] if self.json_object else [])


class ResponseFormat(StrictModel):
    """``response_format``: free text, any JSON object, or JSON that matches a schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


_GUIDES = (
    "response_format",
    "guided_json",
    "guided_regex",
    "guided_grammar",
    "guided_choice",
    "structured_outputs",
)
"""The request fields that constrain the output; a request may use one."""


class _CommonRequest(StrictModel):
    """Fields shared by chat and text completions (OpenAI ranges, plus vLLM-style extras)."""

    model: str
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0, le=2)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    n: Annotated[int, Field(ge=1, le=128)] = 1
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: Annotated[float, Field(ge=-2, le=2)] = 0.0
    frequency_penalty: Annotated[float, Field(ge=-2, le=2)] = 0.0
    # accepted and ignored on purpose (IGNORED_FIELDS says why)
    user: str | None = None
    safety_identifier: str | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    # extras (vLLM names)
    top_k: Annotated[int, Field(ge=1)] | None = None
    min_p: Annotated[float, Field(ge=0, le=1)] = 0.0
    repetition_penalty: Annotated[float, Field(gt=0)] = 1.0
    ignore_eos: bool = False
    min_tokens: Annotated[int, Field(ge=0)] = 0
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    stop_token_ids: list[Annotated[int, Field(ge=0)]] | None = None
    truncate_prompt_tokens: Annotated[int, Field(ge=-1)] | None = None
    """vLLM's: keep the prompt's last k tokens; -1 (or null) keeps it whole."""
    prompt_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    """vLLM's: each prompt token's logprob and this many top ones, as ``prompt_logprobs``."""
    return_tokens_as_token_ids: bool = False
    """vLLM's: logprobs name tokens as ``token_id:N`` (exact even where text is not)."""
    priority: int = 0
    """vLLM's: the order within a replica's engine, lower first (the gateway's classes are
    ``X-Kunlun-Priority``'s)."""
    # structured output: OpenAI's response_format, and vLLM's guided_* spellings
    response_format: ResponseFormat | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_grammar: str | None = None
    guided_choice: list[str] | None = None
    structured_outputs: StructuredOutputs | None = None

    def guide_fields(self) -> list[str]:
        """The request's fields that constrain the output."""
        given = [name for name in _GUIDES if getattr(self, name) is not None]
        if self.response_format is not None and self.response_format.type == "text":
            given.remove("response_format")
        if self.structured_outputs is not None and not self.structured_outputs.given():
            given.remove("structured_outputs")
        return given

    def guide(self) -> Guide | None:
        """The constraint on the output, from the one field that sets one (400 for two)."""
        given = self.guide_fields()
        if len(given) > 1:
            raise param_error(
                given[1], f"use one of {', '.join(given)}: each constrains the output"
            )
        if not given:
            return None
        name = given[0]
        if name == "response_format":
            return _response_format_guide(self.response_format)  # type: ignore[arg-type]
        if name == "guided_json":
            return schema_guide(self.guided_json, name)
        if name == "guided_choice":
            return Guide.choice(self.guided_choice, name)
        if name == "structured_outputs":
            return _structured_outputs_guide(self.structured_outputs)  # type: ignore[arg-type]
        return Guide("regex" if name == "guided_regex" else "grammar", getattr(self, name), name)

    @property
    def include_usage(self) -> bool:
        return self.stream and self.stream_options is not None and self.stream_options.include_usage

    @property
    def continuous_usage(self) -> bool:
        """Whether every chunk carries the usage so far (vLLM's ``continuous_usage_stats``)."""
        options = self.stream_options
        return self.include_usage and options is not None and options.continuous_usage_stats

    def _sampling(self, max_tokens: int | None, logprobs: int | None, prompt_logprobs: int | None
                  ) -> SamplingParams:  # fmt: skip
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if any(not s for s in stop):
            raise param_error("stop", "stop strings must not be empty")
        if self.stream and self.prompt_logprobs is not None:
            raise param_error("prompt_logprobs", "is not sent in a stream (as vLLM): ask "
                              "without stream, or with echo and logprobs (completions)")  # fmt: skip
        return SamplingParams(
            n=self.n,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=self.top_k,
            min_p=self.min_p,
            repetition_penalty=self.repetition_penalty,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            seed=self.seed,
            stop=stop,
            max_tokens=max_tokens,
            ignore_eos=self.ignore_eos,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            guide=self.guide(),
            min_tokens=self.min_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output,
            skip_special_tokens=self.skip_special_tokens,
            stop_token_ids=list(self.stop_token_ids or []),
            truncate_prompt_tokens=(
                self.truncate_prompt_tokens if self.truncate_prompt_tokens != -1 else None
            ),
            priority=self.priority,
        )


def schema_guide(schema: Any, field: str, strict: bool = False) -> Guide:
    """The guide of a JSON schema given as an object or as JSON text (read within the body's
    own bounds), read by :mod:`kunlun.protocol.schemas`."""
    if isinstance(schema, str):
        budgets.require("schema_bytes", field, len(schema.encode("utf-8", "surrogatepass")))
        schema = json_text.loads(schema, field=field)
    return Guide.json_schema(closed(schema, strict=strict), field)


def _structured_outputs_guide(outputs: StructuredOutputs) -> Guide:
    given = outputs.given()
    if len(given) > 1:
        raise param_error(f"structured_outputs.{given[1]}",
                          f"use one of {', '.join(given)}: each constrains the output")  # fmt: skip
    name, field = given[0], f"structured_outputs.{given[0]}"
    if name == "json_object":
        return Guide("json", json.dumps({"type": "object"}), field)
    if name == "json":
        return schema_guide(outputs.json_, field)
    if name == "choice":
        return Guide.choice(outputs.choice, field)
    if name == "regex":
        return Guide("regex", outputs.regex or "", field)
    return Guide("grammar", outputs.grammar or "", field)


def _response_format_guide(fmt: ResponseFormat) -> Guide:
    if fmt.type == "json_object":
        if fmt.json_schema is not None:
            raise param_error("response_format.json_schema", "is for type json_schema only")
        return Guide("json", json.dumps({"type": "object"}), "response_format")
    if fmt.json_schema is None:
        raise param_error("response_format.json_schema", "type json_schema needs json_schema")
    schema = fmt.json_schema.schema_
    if schema is None:
        raise param_error("response_format.json_schema.schema", "the schema is missing")
    field = "response_format.json_schema.schema"
    return schema_guide(schema, field, strict=bool(fmt.json_schema.strict))


class ContentPart(StrictModel):
    type: str
    text: str | None = None
    # the other part types' payloads: the part is refused by its type (text only)
    image_url: dict[str, Any] | None = None
    input_audio: dict[str, Any] | None = None
    file: dict[str, Any] | None = None


class ChatMessage(StrictModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[MessageToolCall] | None = None
    """An assistant message's calls, sent back with their results."""
    tool_call_id: str | None = None
    """A tool message's call."""

    def template_dict(self) -> dict[str, Any]:
        """The message as the chat template sees it (text parts joined)."""
        content = self.content
        if isinstance(content, list):
            if any(part.type != "text" for part in content):
                kinds = sorted({part.type for part in content} - {"text"})
                raise param_error("messages", f"content parts {kinds} are not supported: text only")
            content = "".join(part.text or "" for part in content)
        role = "system" if self.role == "developer" else self.role
        message: dict[str, Any] = {"role": role, "content": content or ""}
        if self.name is not None:
            message["name"] = self.name
        if self.tool_calls:
            message["tool_calls"] = [call.model_dump() for call in self.tool_calls]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        return message


class ChatCompletionRequest(_CommonRequest):
    """``POST /v1/chat/completions``."""

    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    tools: list[ToolDef] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None

    def tool_use(self, chat_template: str | None) -> ToolUse:
        """What this request's tools change (:mod:`kunlun.protocol.tools`); 400s first."""
        guides = self.guide_fields()
        return ToolUse.of(self.tools, self.tool_choice, self.parallel_tool_calls,
                          guides[0] if guides else None, chat_template)  # fmt: skip

    def to_sampling_params(self) -> SamplingParams:
        if self.top_logprobs is not None and not self.logprobs:
            raise param_error("top_logprobs", "top_logprobs needs logprobs=true")
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        max_tokens = self.max_completion_tokens or self.max_tokens
        return self._sampling(max_tokens, logprobs, self.prompt_logprobs)


class TokenizeRequest(StrictModel):
    """``POST /tokenize`` (vLLM's shape): a ``prompt``, or chat ``messages`` through the
    model's chat template."""

    model: str | None = None
    """The model whose tokenizer: where it is left out, the only generation model served."""
    prompt: str | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1)] | None = None
    add_special_tokens: bool = True
    """For a ``prompt``: what the tokenizer adds (a BOS, for many models)."""
    add_generation_prompt: bool = True
    """For ``messages``: end with the assistant's turn opening, as a chat request does."""

    def checked(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise param_error("prompt", "give exactly one of prompt and messages")
        return self


class DetokenizeRequest(StrictModel):
    """``POST /detokenize``: token ids back to text."""

    model: str | None = None
    tokens: TokenIds


Prompt = str | TokenIds


class CompletionRequest(_CommonRequest):
    """``POST /v1/completions``."""

    prompt: str | list[str] | TokenIds | list[TokenIds]
    echo: bool = False
    logprobs: Annotated[int, Field(ge=0, le=5)] | None = None
    max_tokens: Annotated[int, Field(ge=1)] | None = 16  # OpenAI's default for completions

    def prompts(self) -> list[Prompt]:
        """The prompts as a list (text or token ids), one per batch entry."""
        prompt = self.prompt
        if isinstance(prompt, str):
            return [prompt]
        if not prompt:
            raise param_error("prompt", "prompt is empty")
        if isinstance(prompt[0], int):
            return [prompt]
        return list(prompt)

    def to_sampling_params(self) -> SamplingParams:
        prompt_logprobs = self.logprobs if self.echo and self.logprobs is not None else None
        if self.prompt_logprobs is not None:
            prompt_logprobs = max(prompt_logprobs or 0, self.prompt_logprobs)
        return self._sampling(self.max_tokens, self.logprobs, prompt_logprobs)


def request_sequences(payload: dict[str, Any]) -> tuple[int, int]:
    """``(prompts, n)`` of a chat or text completion body, as parsed JSON (not validated:
    a malformed field counts as its default): one request runs ``prompts * n`` sequences.
    A chat request has one prompt; a completion's ``prompt`` may be a list of prompts."""
    n = payload.get("n")
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        n = 1
    prompt = payload.get("prompt")
    if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
        return len(prompt), n
    return 1, n
