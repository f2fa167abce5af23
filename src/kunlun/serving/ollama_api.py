"""Ollama's API on the engine worker: ``POST /api/chat``, ``/api/generate``, ``/api/embed``,
``/api/embeddings`` and ``/api/show``, answered from the same engine, checks and request
log as the OpenAI routes (:mod:`kunlun.protocol.ollama` reads the bodies into the OpenAI
requests they mean, :class:`~kunlun.serving.worker_app.WorkerApp` runs them).

Streamed answers are NDJSON: one object per line with the new text (``message.content``, or
``response`` for ``/api/generate``), a tool call whole in ``message.tool_calls`` once written,
and a last object with ``done: true``, ``done_reason`` and the token counts. A stream that
fails ends with ``{"error": ...}`` on its own line, as Ollama ends one.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from fastapi import Request
from fastapi.responses import Response

from kunlun.limits import CLIENT_GONE
from kunlun.protocol import ollama
from kunlun.protocol.embedding_request import EmbeddingRequest
from kunlun.protocol.openai_api import ChatCompletionRequest, CompletionRequest
from kunlun.protocol.openai_errors import error_status_and_body
from kunlun.protocol.request_body import parse_request
from kunlun.protocol.tools import ToolUse
from kunlun.serving.worker_calls import Call, json_response, new_call, off_loop_if_large
from kunlun.serving.worker_core import StartChat, StartCompletion, WorkerCore
from kunlun.serving.worker_stream import Deltas, ToolCallDeltas

if TYPE_CHECKING:
    from kunlun.serving.embeddings import Embeddings


def line(body: dict[str, Any]) -> bytes:
    return json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode() + b"\n"


def error_line(exc: BaseException) -> bytes:
    """The last line of a stream that failed: ``{"error": message}``."""
    return line({"error": error_status_and_body(exc)[1]["error"]["message"]})


def _as_openai(model: type[Any], body: dict[str, Any]) -> Any:
    return parse_request(model, json.dumps(body).encode())


class OllamaRoutes:
    """The Ollama routes of one worker: ``start_chat`` and ``start_completion`` check and
    queue a chat or text completion as the OpenAI routes do (:class:`WorkerApp`'s)."""

    def __init__(self, worker: WorkerCore, start_chat: StartChat,
                 start_completion: StartCompletion, embeddings: Embeddings) -> None:  # fmt: skip
        self.worker = worker
        self.start_chat, self.start_completion = start_chat, start_completion
        self.embeddings = embeddings

    async def chat(self, request: Request) -> Response:
        raw = await request.body()
        call = new_call(request)
        asked = await off_loop_if_large(raw, parse_request, ollama.OllamaChat, raw)
        req = _as_openai(ChatCompletionRequest, asked.openai())
        return await self._chat(request, raw, call, req, "message")

    async def generate(self, request: Request) -> Response:
        raw = await request.body()
        call = new_call(request)
        asked = await off_loop_if_large(raw, parse_request, ollama.OllamaGenerate, raw)
        if not asked.prompt:  # Ollama's way of asking that the model be loaded: it is
            body = {**ollama.chunk(asked.model, "response", ""), "done": True,
                    "done_reason": "load"}  # fmt: skip
            self.worker.check_model(asked.model)
            return self.worker.finish(call, json_response(call, body))
        body = asked.openai()
        if not asked.raw:
            req = _as_openai(ChatCompletionRequest, body)
            return await self._chat(request, raw, call, req, "response")
        text = _as_openai(CompletionRequest, body)
        submitted, _, _ = await self.start_completion(request, raw, text)
        return await self._answer(request, call, text.model, submitted, None, "response",
                                  text.stream)  # fmt: skip

    async def _chat(
        self, request: Request, raw: bytes, call: Call, req: ChatCompletionRequest, key: str
    ) -> Response:
        submitted, tools, _ = await self.start_chat(request, raw, req)
        return await self._answer(request, call, req.model, submitted, tools, key, req.stream)

    async def _answer(self, request: Request, call: Call, model: str, submitted: Any,
                      tools: ToolUse | None, key: str, stream: bool) -> Response:  # fmt: skip
        worker = self.worker
        if stream:
            events = _lines(worker.deltas(call, submitted.streams), call, model, tools, key)
            return worker.sse(call, submitted, events, ollama.NDJSON, error_line)
        outputs = await worker.collect(request, call, submitted)
        if outputs is None:
            return worker.finish(call, Response(status_code=CLIENT_GONE))
        output = outputs[0].outputs[0]
        text, calls, finish = output.text, None, output.finish_reason
        if tools is not None:
            message, finish = tools.answer(output.text, output.finish_reason)
            text, calls = message.get("content") or "", message.get("tool_calls")
        value = ollama.message(text, calls) if key == "message" else text
        usage = call.usage()
        body = ollama.final(model, key, value, finish, usage["prompt_tokens"],
                            usage["completion_tokens"], call.started)  # fmt: skip
        return worker.finish(call, json_response(call, body))

    async def embed(self, request: Request) -> Response:
        """``/api/embed`` (``embeddings``: a list) and ``/api/embeddings`` (``embedding``)."""
        raw = await request.body()
        call = new_call(request)
        asked = await off_loop_if_large(raw, parse_request, ollama.OllamaEmbed, raw)
        req = _as_openai(EmbeddingRequest, asked.openai())
        vectors = await self.embeddings.vectors(request, raw, req, call)
        if request.url.path.endswith("/embeddings"):
            return self.worker.finish(call, json_response(call, {"embedding": vectors[0].tolist()}))
        tokens = sum(call.num_prompt.values())
        body = {"model": asked.model, "embeddings": [v.tolist() for v in vectors],
                "total_duration": 0, "load_duration": 0, "prompt_eval_count": tokens}  # fmt: skip
        return self.worker.finish(call, json_response(call, body))

    async def show(self) -> dict[str, Any]:
        """``/api/show``: the model's template, size and what it can do."""
        worker = self.worker
        engine = worker.engine.engine
        config = getattr(engine.runner, "config", None)
        architecture = str(getattr(config, "architecture", "") or "")
        embeds = self.embeddings.task == "embed"
        return {
            "modelfile": "", "parameters": "", "license": "",
            "template": worker.tokenizer.chat_template or "",
            "details": ollama.details(architecture, str(engine.config.dtype)),
            "model_info": {"general.architecture": architecture,
                           "general.context_length": worker.max_model_len},
            "capabilities": ["embedding"] if embeds else ["completion", "tools"],
        }  # fmt: skip


async def _lines(
    deltas: Deltas, call: Call, model: str, tools: ToolUse | None, key: str
) -> AsyncIterator[bytes]:
    """The NDJSON lines of a streamed answer (choice 0: Ollama has no ``n``)."""
    calls = ToolCallDeltas(tools, whole=True) if tools is not None else None
    async for _, delta in deltas:
        text, finish = delta.text, delta.finish_reason
        found: list[dict[str, Any]] = []
        if calls is not None:
            text, found, finish = calls.read(delta)
        if text or found:
            value = ollama.message(text, found) if key == "message" else text
            yield line(ollama.chunk(model, key, value))
        if delta.finish_reason is not None:
            usage = call.usage()
            empty = ollama.message("") if key == "message" else ""
            yield line(ollama.final(model, key, empty, finish, usage["prompt_tokens"],
                                    usage["completion_tokens"], call.started))  # fmt: skip


def add_ollama_routes(app: Any, routes: OllamaRoutes) -> None:
    """Register Ollama's routes on the worker's app."""
    app.post("/api/chat")(routes.chat)
    app.post("/api/generate")(routes.generate)
    app.post("/api/embed")(routes.embed)
    app.post("/api/embeddings")(routes.embed)
    app.post("/api/show")(routes.show)
