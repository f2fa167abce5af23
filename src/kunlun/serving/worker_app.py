"""The engine worker's HTTP app: the OpenAI API over one :class:`AsyncLLMEngine`.

Routes: ``POST /v1/chat/completions`` and ``/v1/completions`` (JSON, or SSE with
``stream``: :mod:`kunlun.serving.worker_stream`), ``POST /v1/embeddings``
(:mod:`kunlun.serving.embeddings`; each route refuses a model served for the other task),
``POST /tokenize`` and ``/detokenize`` (vLLM's), ``GET /v1/models``, ``GET /health``,
``GET /stats`` (engine statistics) and ``GET /metrics`` (Prometheus;
:mod:`kunlun.telemetry.worker_metrics`), and SGLang's native ``/generate``,
``/get_model_info``, ``/get_server_info``, ``/flush_cache`` (:mod:`kunlun.serving.sglang_api`).
Bad input answers 400 in the OpenAI error shape before anything is queued. What the routes
share, the prompt checks, the engine requests, disconnects, the streamed response and the
request log, is :class:`~kunlun.serving.worker_core.WorkerCore`, which :class:`WorkerApp`
extends with the OpenAI routes.
"""

from __future__ import annotations

import dataclasses
import hmac
import uuid
from collections.abc import Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from kunlun import budgets
from kunlun import headers as http_headers
from kunlun.engine.async_engine import AsyncLLMEngine
from kunlun.engine.launch import FaultSpec, Pooling, Task
from kunlun.engine.sampling_params import SamplingParams
from kunlun.errors import KunlunError
from kunlun.limits import CLIENT_GONE
from kunlun.protocol import responses
from kunlun.protocol.openai_api import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from kunlun.protocol.openai_errors import AuthenticationError, error_status_and_body, param_error
from kunlun.protocol.request_body import parse_request
from kunlun.protocol.tools import ToolUse
from kunlun.serving.embeddings import Embeddings
from kunlun.serving.handoff import DIRECT_WRITER_SCOPE
from kunlun.serving.ollama_api import OllamaRoutes, add_ollama_routes
from kunlun.serving.responses_api import ResponsesRoute
from kunlun.serving.sglang_api import add_sglang_routes
from kunlun.serving.worker_calls import Call, json_response, new_call, off_loop_if_large
from kunlun.serving.worker_core import Submitted, WorkerCore
from kunlun.serving.worker_stream import EngineWrites, chat_events, completion_events


class WorkerApp(WorkerCore):
    """The OpenAI routes over one engine serving one model name."""

    def __init__(
        self,
        engine: AsyncLLMEngine,
        served_name: str,
        log: Callable[[str], None],
        faults: FaultSpec | None = None,
        task: Task = "generate",
        pooling: Pooling = "mean",
    ) -> None:
        super().__init__(engine, served_name, log, faults)
        self.embeddings = Embeddings(self, task, pooling)
        """``POST /v1/embeddings``, and the task check of chat and completions."""

    async def start_chat(
        self, request: Request, raw: bytes, req: ChatCompletionRequest
    ) -> tuple[Submitted, ToolUse, SamplingParams]:
        """A chat request checked and queued: its engine request, tools and sampling."""
        self.check_model(req.model)
        self.embeddings.refuse_generation()
        await self.faults.apply(request.headers)
        tools = req.tool_use(self.tokenizer.chat_template)
        params = tools.sampling(req.to_sampling_params())  # tool_choice required or named
        messages = tools.messages([m.template_dict() for m in req.messages])
        prompt = await off_loop_if_large(
            raw, self.chat_prompt, messages, tools.template_variables()
        )
        return await self.submit([prompt], params), tools, params

    async def start_completion(
        self, request: Request, raw: bytes, req: CompletionRequest
    ) -> tuple[Submitted, SamplingParams, list[str] | None]:
        """A text completion checked and queued: its engine requests (one per prompt), its
        sampling, and its prompts' texts where it echoes them."""
        self.check_model(req.model)
        self.embeddings.refuse_generation()
        await self.faults.apply(request.headers)
        params = req.to_sampling_params()
        prompts = req.prompts()
        for prompt in prompts:  # refuse what cannot fit before tokenizing anything
            self.check_prompt(prompt)
        echo_texts = None
        if req.echo:
            echo_texts = [p if isinstance(p, str) else self.tokenizer.decode(p) for p in prompts]
        if any(isinstance(p, str) for p in prompts):
            prompts = await off_loop_if_large(raw, self.encode_all, prompts)
            for prompt in prompts:  # the engine would check each id of a long one first
                self.check_prompt(prompt)
        return await self.submit(prompts, params), params, echo_texts

    async def chat_completions(self, request: Request) -> Response:
        raw = await request.body()
        call = new_call(request)  # timed from the whole request's arrival
        req = await off_loop_if_large(raw, parse_request, ChatCompletionRequest, raw)
        submitted, tools, params = await self.start_chat(request, raw, req)
        tokens = self.tokens_for(req)
        response_id = f"chatcmpl-{uuid.uuid4().hex}"
        if req.stream:
            plain = (params.logprobs is None and params.n == 1 and not req.continuous_usage
                     and not tools.reads_calls)  # fmt: skip
            writes = self.engine_writes(request, submitted, call, plain)
            events = chat_events(self.deltas(call, submitted.streams), call, req, response_id,
                                 tokens, params.logprobs, tools, writes)  # fmt: skip
            return self.sse(call, submitted, events)
        outputs = await self.collect(request, call, submitted)
        if outputs is None:
            return self.finish(call, Response(status_code=CLIENT_GONE))
        body = responses.chat_completion(
            response_id, req.model, outputs[0], tokens, params.logprobs
        )
        for choice, output in zip(body["choices"], outputs[0].outputs, strict=True):
            choice["message"], choice["finish_reason"] = tools.answer(
                output.text, output.finish_reason
            )
        if req.prompt_logprobs is not None:
            body["prompt_logprobs"] = self.prompt_logprobs(outputs[0], req.prompt_logprobs)
        return self.finish(call, json_response(call, body))

    async def completions(self, request: Request) -> Response:
        raw = await request.body()
        call = new_call(request)  # timed from the whole request's arrival
        req = await off_loop_if_large(raw, parse_request, CompletionRequest, raw)
        submitted, params, echo_texts = await self.start_completion(request, raw, req)
        tokens = self.tokens_for(req)
        response_id = f"cmpl-{uuid.uuid4().hex}"
        if req.stream:
            plain = params.logprobs is None and params.n == 1 and not req.continuous_usage
            writes = self.engine_writes(request, submitted, call, plain)
            events = completion_events(self.deltas(call, submitted.streams), call, req,
                                       response_id, tokens, params.logprobs,
                                       echo_texts, writes)  # fmt: skip
            return self.sse(call, submitted, events)
        outputs = await self.collect(request, call, submitted)
        if outputs is None:
            return self.finish(call, Response(status_code=CLIENT_GONE))
        body = responses.text_completion(
            response_id, req.model, outputs, tokens, params.logprobs, echo_texts
        )
        if req.prompt_logprobs is not None:
            n = params.n
            for index, choice in enumerate(body["choices"]):
                choice["prompt_logprobs"] = self.prompt_logprobs(
                    outputs[index // n], req.prompt_logprobs
                )
        return self.finish(call, json_response(call, body))

    def engine_writes(
        self, request: Request, submitted: Submitted, call: Call, plain: bool
    ) -> EngineWrites | None:
        """The engine thread's writing of a stream's events (:class:`EngineWrites`): for a
        ``plain`` stream (one prompt, one choice, no logprobs, tool calls or usage in every
        event) handed to this worker as a direct answer; None otherwise."""
        writer = request.scope.get(DIRECT_WRITER_SCOPE)
        if writer is None or not plain or len(submitted.request_ids) != 1:
            return None
        return EngineWrites(self.engine.attach_sink, submitted.request_ids[0], writer.write_now,
                            call)  # fmt: skip

    async def tokenize(self, request: Request) -> dict[str, Any]:
        """``POST /tokenize``: the token ids a prompt (or chat) would be given, as the
        completions and chat routes encode it."""
        raw = await request.body()
        req = (await off_loop_if_large(raw, parse_request, TokenizeRequest, raw)).checked()
        self.check_model(req.model or self.served_name)
        if req.messages is not None:
            messages = [m.template_dict() for m in req.messages]
            text = self.tokenizer.apply_chat_template(
                messages, add_generation_prompt=req.add_generation_prompt
            )
            tokens = self.tokenizer.encode(text, add_special_tokens=False)
        else:
            self.check_prompt(req.prompt or "")
            tokens = self.tokenizer.encode(
                req.prompt or "", add_special_tokens=req.add_special_tokens
            )
        return {"count": len(tokens), "max_model_len": self.max_model_len, "tokens": tokens}

    async def detokenize(self, request: Request) -> dict[str, Any]:
        """``POST /detokenize``: the text of token ids (special tokens kept)."""
        raw = await request.body()
        req = await off_loop_if_large(raw, parse_request, DetokenizeRequest, raw)
        self.check_model(req.model or self.served_name)
        budgets.require("detokenize_ids", "tokens", len(req.tokens))
        vocab = self.engine.engine.vocab_size
        if max(req.tokens, default=0) >= vocab:
            bad = next(i for i, t in enumerate(req.tokens) if t >= vocab)
            raise param_error(
                f"tokens.{bad}", f"token {req.tokens[bad]} is not an id of this model (< {vocab})"
            )
        return {"prompt": await off_loop_if_large(raw, self.tokenizer.decode, req.tokens, False)}

    async def tokenizer_info(self) -> dict[str, Any]:
        """vLLM's ``/tokenizer_info``: what a client needs to tokenize as this model does
        through ``/tokenize`` and ``/detokenize`` (lm-eval's remote tokenizer reads it), with no
        tokenizer files of its own: the special tokens' text and the chat template."""
        tokenizer = self.tokenizer
        return {"tokenizer_class": "PreTrainedTokenizerFast", "model": self.served_name,
                **tokenizer.special_tokens, "chat_template": tokenizer.chat_template,
                "model_max_length": self.max_model_len,
                "vocab_size": self.engine.engine.vocab_size}  # fmt: skip

    async def models(self) -> dict[str, Any]:
        model = {"id": self.served_name, "object": "model", "created": self.created,
                 "owned_by": "kunlun", "task": self.embeddings.task}  # fmt: skip
        return {"object": "list", "data": [model]}

    async def stats(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self.engine.stats()), "num_active_http": self.num_active}

    async def health(self) -> dict[str, str]:
        return {"status": "ok"}

    def error(self, request: Request, exc: Exception) -> Response:
        """The one error answer of this app (OpenAI shape), logged like any request."""
        status, body, headers = error_status_and_body(exc)
        call = new_call(request)
        call.status = status
        self.log(call.log_line())
        self.telemetry.observe(call)  # telemetry
        headers[http_headers.REQUEST_ID] = call.request_id
        return JSONResponse(body, status_code=status, headers=headers)


def create_worker_app(
    engine: AsyncLLMEngine,
    served_name: str,
    log: Callable[[str], None] = print,
    faults: FaultSpec | None = None,
    task: Task = "generate",
    pooling: Pooling = "mean",
) -> FastAPI:
    """The worker's FastAPI app over ``engine``, serving it as model ``served_name`` for
    ``task`` (embeddings pooled by ``pooling``: :mod:`kunlun.serving.embeddings`), with
    ``faults`` injected into client requests (:mod:`kunlun.serving.faults`)."""
    worker = WorkerApp(engine, served_name, log, faults, task, pooling)
    app = FastAPI(title="Kunlun engine worker", docs_url=None, redoc_url=None)
    app.state.worker = worker
    app.post("/v1/chat/completions")(worker.chat_completions)
    app.post("/v1/completions")(worker.completions)
    app.post("/v1/embeddings")(worker.embeddings)
    app.get("/v1/models")(worker.models)
    app.post("/tokenize")(worker.tokenize)
    app.post("/detokenize")(worker.detokenize)
    app.get("/tokenizer_info")(worker.tokenizer_info)
    ollama = OllamaRoutes(worker, worker.start_chat, worker.start_completion, worker.embeddings)
    add_ollama_routes(app, ollama)  # Ollama's API
    app.post("/v1/responses")(ResponsesRoute(worker, worker.start_chat))  # OpenAI's Responses
    app.post("/tokenizer_info", include_in_schema=False)(worker.tokenizer_info)
    add_sglang_routes(app, worker)  # SGLang's native API
    app.get("/health")(worker.health)
    app.get("/stats")(worker.stats)
    app.get("/metrics")(worker.telemetry.metrics)  # telemetry
    app.add_exception_handler(KunlunError, worker.error)
    app.add_exception_handler(Exception, worker.error)
    return app


class KeyGuard:
    """The worker's door when its launch has a key: every HTTP request (direct streams' too)
    must carry it (:data:`kunlun.headers.WORKER_KEY`); any other is answered 401, unread. Only
    the node's daemon knows the key, so no other local process reaches the model past the
    gateway's API keys."""

    def __init__(self, app: Any, key: str) -> None:
        self.app = app
        self._key = key.encode()
        self._header = http_headers.raw(http_headers.WORKER_KEY)

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            given = next((v for k, v in scope["headers"] if k == self._header), b"")
            if not hmac.compare_digest(given, self._key):
                status, body, _ = error_status_and_body(AuthenticationError(
                    f"this worker answers its node's daemon only: the request has no valid "
                    f"{http_headers.WORKER_KEY}", hint="send requests to the daemon's port"))  # fmt: skip
                await JSONResponse(body, status_code=status)(scope, receive, send)
                return
        await self.app(scope, receive, send)
