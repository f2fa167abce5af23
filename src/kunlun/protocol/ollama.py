"""Ollama's API (``/api/chat``, ``/api/generate``, ``/api/embed``, ``/api/embeddings``): its
request bodies, read as the OpenAI requests they ask for, and its answers.

Many tools (Open WebUI, Continue, editors' assistants) speak only Ollama's API; the daemon
serves it from the same workloads, keys, admission and metrics as the OpenAI routes. A body is
read into the OpenAI request it means (:meth:`OllamaChat.openai`, :meth:`OllamaGenerate.openai`,
:meth:`OllamaEmbed.openai`), so every field is checked and honoured as there; the answer is
written in Ollama's shapes (:func:`chunk`, :func:`final`), streamed as NDJSON (one JSON object
per line, ``"done": true`` on the last), which is Ollama's default (``"stream": false`` for one
object).

``options`` map to the sampling fields (``num_predict`` -> ``max_tokens``, ``temperature``,
``top_p``, ``top_k``, ``min_p``, ``seed``, ``stop``, ``repeat_penalty`` ->
``repetition_penalty``, ``presence_penalty``, ``frequency_penalty``). The options that place
or size the model (:data:`RUNTIME_OPTIONS`: ``num_ctx``, ``num_gpu``, ``num_thread``...) and
``keep_alive`` are the workload's to decide and are accepted and ignored: they do not change
an answer (a prompt longer than the workload's context is a 400, never cut). Options and
fields that would change the answer and are not implemented (:data:`UNSUPPORTED`) are 400s
naming them, like any unknown field.
"""

from __future__ import annotations

import json
import time
from datetime import UTC, datetime
from typing import Annotated, Any, Literal

from pydantic import Field, model_validator

from kunlun.protocol.fields import StrictModel
from kunlun.protocol.openai_errors import param_error
from kunlun.protocol.tools import ToolDef

NDJSON = "application/x-ndjson"

RUNTIME_OPTIONS = ("num_ctx", "num_batch", "num_gpu", "main_gpu", "low_vram", "num_thread",
                   "use_mmap", "use_mlock", "numa", "vocab_only", "f16_kv", "logits_all",
                   "embedding_only")  # fmt: skip
"""Options that place or size the model: the workload's plan decides them (accepted, ignored)."""

UNSUPPORTED = {
    "tfs_z": "tail-free sampling", "typical_p": "locally typical sampling",
    "mirostat": "mirostat sampling", "mirostat_tau": "mirostat sampling",
    "mirostat_eta": "mirostat sampling", "penalize_newline": "newline penalty",
    "repeat_last_n": "a repetition window (the repeat penalty reads the whole text)",
    "num_keep": "context shifting", "images": "image input", "suffix": "fill-in-the-middle",
    "template": "a per-request prompt template", "context": "the deprecated context tokens",
    "logprobs": "logprobs on the Ollama API (use /v1/chat/completions)",
    "top_logprobs": "logprobs on the Ollama API (use /v1/chat/completions)",
}  # fmt: skip
"""Ollama fields and options this server does not implement, and what they are for."""


def _refuse_unsupported(data: Any, where: str) -> Any:
    if isinstance(data, dict):
        for name, purpose in UNSUPPORTED.items():
            if data.get(name) not in (None, False, [], ""):
                raise param_error(f"{where}{name}", f"is not supported by this server "
                                  f"({purpose} is not implemented); remove it")  # fmt: skip
    return data


class OllamaOptions(StrictModel):
    """``options``: the sampling ones honoured, the runtime ones accepted and ignored."""

    num_predict: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: list[str] | None = None
    repeat_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    # the workload's to decide (RUNTIME_OPTIONS)
    num_ctx: int | None = None
    num_batch: int | None = None
    num_gpu: int | None = None
    main_gpu: int | None = None
    low_vram: bool | None = None
    num_thread: int | None = None
    use_mmap: bool | None = None
    use_mlock: bool | None = None
    numa: bool | None = None
    vocab_only: bool | None = None
    f16_kv: bool | None = None
    logits_all: bool | None = None
    embedding_only: bool | None = None

    @model_validator(mode="before")
    @classmethod
    def _unsupported(cls, data: Any) -> Any:
        return _refuse_unsupported(data, "options.")

    def sampling(self) -> dict[str, Any]:
        """The OpenAI request fields these options set."""
        mapped = {"max_tokens": None if self.num_predict is None or self.num_predict < 0
                  else self.num_predict,  # (-1: until the context is full)
                  "temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k,
                  "seed": self.seed, "stop": self.stop, "min_p": self.min_p,
                  "repetition_penalty": self.repeat_penalty,
                  "presence_penalty": self.presence_penalty,
                  "frequency_penalty": self.frequency_penalty}  # fmt: skip
        return {k: v for k, v in mapped.items() if v is not None}


class _Generating(StrictModel):
    """Fields of ``/api/chat`` and ``/api/generate``."""

    model: str
    format: Literal["", "json"] | dict[str, Any] | None = None
    options: OllamaOptions | None = None
    stream: bool = True
    keep_alive: float | str | None = None
    """Accepted, ignored: the workload keeps its model loaded."""
    think: bool | Literal["low", "medium", "high"] | None = None

    @model_validator(mode="before")
    @classmethod
    def _unsupported(cls, data: Any) -> Any:
        return _refuse_unsupported(data, "")

    def common(self) -> dict[str, Any]:
        """The OpenAI fields of the output's form and sampling."""
        if self.think not in (None, False):
            raise param_error("think", "thinking models' separate reasoning is not served on "
                              "this API: send think false, or leave it out")  # fmt: skip
        body: dict[str, Any] = {"model": self.model, "stream": self.stream}
        if self.stream:
            body["stream_options"] = {"include_usage": True}
        if self.format == "json":
            body["response_format"] = {"type": "json_object"}
        elif isinstance(self.format, dict):
            body["response_format"] = {"type": "json_schema",
                                       "json_schema": {"name": "format", "schema": self.format}}  # fmt: skip
        return {**body, **(self.options.sampling() if self.options else {})}


class OllamaFunction(StrictModel):
    name: str
    arguments: dict[str, Any] = Field(default_factory=dict)


class OllamaToolCall(StrictModel):
    function: OllamaFunction


class OllamaMessage(StrictModel):
    role: Literal["system", "user", "assistant", "tool"]
    content: str = ""
    tool_calls: list[OllamaToolCall] | None = None
    tool_name: str | None = None
    """A tool message's function (Ollama names the function, not a call id)."""
    thinking: str | None = None
    """An earlier answer's reasoning: accepted, not sent back to the model."""

    @model_validator(mode="before")
    @classmethod
    def _unsupported(cls, data: Any) -> Any:
        return _refuse_unsupported(data, "messages.")


class OllamaChat(_Generating):
    """``POST /api/chat``."""

    messages: list[OllamaMessage] = Field(default_factory=list)
    tools: list[ToolDef] | None = None

    def openai(self) -> dict[str, Any]:
        """The body of the ``/v1/chat/completions`` request this one means."""
        messages, calls = [], 0
        for message in self.messages:
            entry: dict[str, Any] = {"role": message.role, "content": message.content}
            if message.tool_calls:
                entry["tool_calls"] = []
                for call in message.tool_calls:
                    calls += 1
                    entry["tool_calls"].append({
                        "id": f"call_{calls}", "type": "function",
                        "function": {"name": call.function.name,
                                     "arguments": _json(call.function.arguments)}})  # fmt: skip
            if message.role == "tool":
                entry["tool_call_id"] = f"call_{calls}"  # the latest call's result
            messages.append(entry)
        if not messages:
            raise param_error("messages", "messages is empty: give at least one message")
        body = {**self.common(), "messages": messages}
        if self.tools:
            body["tools"] = [t.model_dump(exclude_none=True) for t in self.tools]
        return body


class OllamaGenerate(_Generating):
    """``POST /api/generate``: a prompt through the model's chat template (with ``system``),
    or as it is with ``raw``. An empty prompt only asks that the model be loaded."""

    prompt: str = ""
    system: str | None = None
    raw: bool = False

    def openai(self) -> dict[str, Any]:
        """The body of the chat (or, ``raw``, text) completion this request means."""
        if self.raw:
            if self.system:
                raise param_error("system", "is not used with raw: the prompt is sent as it is")
            return {**self.common(), "prompt": self.prompt}
        messages = [{"role": "system", "content": self.system}] if self.system else []
        messages.append({"role": "user", "content": self.prompt})
        return {**self.common(), "messages": messages}


class OllamaEmbed(StrictModel):
    """``POST /api/embed`` (``input``) and the older ``/api/embeddings`` (``prompt``)."""

    model: str
    input: str | Annotated[list[str], Field(min_length=1)] | None = None
    prompt: str | None = None
    truncate: bool | None = None
    """Accepted: an input longer than the model takes is a 400 either way (never cut)."""
    dimensions: int | None = None
    options: OllamaOptions | None = None
    keep_alive: float | str | None = None

    def openai(self) -> dict[str, Any]:
        given = self.input if self.input is not None else self.prompt
        if given is None:
            raise param_error("input", "give the text to embed in input")
        body: dict[str, Any] = {"model": self.model, "input": given}
        if self.dimensions is not None:
            body["dimensions"] = self.dimensions
        return body


def details(architecture: str, dtype: str, quantization: str | None = None) -> dict[str, Any]:
    """A model's ``details`` as Ollama lists them."""
    family = architecture.removesuffix("ForCausalLM").lower() or "unknown"
    return {"format": "safetensors", "family": family, "families": [family],
            "parameter_size": "", "parent_model": "",
            "quantization_level": (quantization or dtype.removeprefix("torch.")).upper()}  # fmt: skip


def _json(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


def created_at() -> str:
    """Now, as Ollama writes times (RFC 3339, UTC)."""
    return datetime.now(UTC).isoformat().replace("+00:00", "Z")


def message(text: str, tool_calls: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """An assistant message in Ollama's shape (a call's arguments as an object)."""
    body: dict[str, Any] = {"role": "assistant", "content": text}
    if tool_calls:
        body["tool_calls"] = [{"function": {"name": c["function"]["name"],
                                            "arguments": json.loads(c["function"]["arguments"])}}
                              for c in tool_calls]  # fmt: skip
    return body


def chunk(model: str, key: str, value: Any) -> dict[str, Any]:
    """One streamed object, ``done`` false (``key``: ``message`` or ``response``)."""
    return {"model": model, "created_at": created_at(), key: value, "done": False}


def final(model: str, key: str, value: Any, finish_reason: str | None, prompt_tokens: int,
          output_tokens: int, started: float) -> dict[str, Any]:  # fmt: skip
    """The last object: ``done`` true with the reason and the counts Ollama reports
    (durations in nanoseconds, from the call's arrival)."""
    total = int((time.perf_counter() - started) * 1e9)
    reason = "length" if finish_reason == "length" else "stop"
    return {"model": model, "created_at": created_at(), key: value, "done": True,
            "done_reason": reason, "total_duration": total, "load_duration": 0,
            "prompt_eval_count": prompt_tokens, "prompt_eval_duration": 0,
            "eval_count": output_tokens, "eval_duration": total}  # fmt: skip
