"""The engine worker's HTTP app: the OpenAI API over one :class:`AsyncLLMEngine`.

Routes: ``POST /v1/chat/completions`` and ``/v1/completions`` (JSON, or SSE with
``stream``), ``POST /v1/embeddings`` (:mod:`kunlun.serving.embeddings`; each route refuses a
model served for the other task), ``GET /v1/models``, ``GET /health``, ``GET /stats`` (engine
statistics) and ``GET /metrics`` (Prometheus; :mod:`kunlun.telemetry.worker_metrics`), and
SGLang's native ``/generate``, ``/get_model_info``, ``/get_server_info``, ``/flush_cache``
(:mod:`kunlun.serving.sglang_api`).
Bad input answers 400 in the OpenAI error shape before anything is queued; a text prompt
that cannot fit the context is refused before it is tokenized (:meth:`WorkerApp.check_prompt`),
and for a large body, parsing, rendering the chat template and tokenizing run in a thread, so
that a long prompt does not stall the event loop other requests stream on; a client that
goes away aborts its generation (the engine frees its KV blocks); a request that fails while
streaming ends with one SSE error event and no ``[DONE]``. One line per finished request is
logged through the ``log`` callable (the worker prints it to stdout for the node agent).
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from kunlun import budgets
from kunlun import headers as http_headers
from kunlun.engine.async_engine import AsyncLLMEngine
from kunlun.engine.launch import FaultSpec, Pooling, Task
from kunlun.engine.outputs import RequestOutput, RequestOutputDelta
from kunlun.engine.sampling_params import SamplingParams
from kunlun.errors import EngineError, KunlunError, PromptTooLong
from kunlun.limits import CLIENT_GONE
from kunlun.protocol import responses, sse
from kunlun.protocol.openai_api import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    ModelNotFound,
    Prompt,
    TokenizeRequest,
    error_status_and_body,
    param_error,
    parse_request,
)
from kunlun.protocol.tool_formats import ToolStream
from kunlun.protocol.tools import ToolUse
from kunlun.serving.faults import PROBE_HEADER, Faults
from kunlun.serving.sglang_api import add_sglang_routes
from kunlun.telemetry.worker_metrics import WorkerTelemetry  # telemetry

if TYPE_CHECKING:
    from kunlun.serving.embeddings import Embeddings

_T = TypeVar("_T")
"""Logged status of a request whose client disconnected (nginx's convention)."""
SURE_PIECE_CHARS = 16_384
"""Characters tokenized at a time to learn that a long prompt cannot fit."""
PROMPT_BYTES_MARGIN = 2
"""A text prompt longer than ``max_model_len x max_token_bytes x PROMPT_BYTES_MARGIN`` UTF-8
bytes is refused without tokenizing it (it cannot fit); the margin covers normalizers that
shrink text."""
_THREAD_BODY_BYTES = 64 << 10
"""Bodies larger than this are parsed, and their prompts rendered and tokenized, in a thread
(smaller ones are cheaper in place). A JSON body is never shorter than the text it holds."""


@dataclasses.dataclass
class _Call:
    """One API call as the log line reports it."""

    request_id: str
    started: float = dataclasses.field(default_factory=time.perf_counter)
    first_token: float | None = None
    status: int = 200
    num_completion: int = 0
    num_prompt: dict[int, int] = dataclasses.field(default_factory=dict)
    num_cached: dict[int, int] = dataclasses.field(default_factory=dict)
    finals: list[RequestOutput] = dataclasses.field(default_factory=list)  # telemetry
    probe: bool = False  # a health check's probe: logged and counted as such

    def observe(self, prompt_index: int, delta: RequestOutputDelta) -> None:
        if delta.final is not None:  # telemetry: engine timings of the finished request
            self.finals.append(delta.final)
        if delta.token_ids:
            if self.first_token is None:
                self.first_token = time.perf_counter()
            self.num_completion += len(delta.token_ids)
        self.num_prompt[prompt_index] = delta.num_prompt_tokens
        self.num_cached[prompt_index] = delta.num_cached_tokens

    def usage(self) -> dict[str, Any]:
        return responses.usage(
            sum(self.num_prompt.values()), self.num_completion, sum(self.num_cached.values())
        )

    def log_line(self) -> str:
        ttft = "-" if self.first_token is None else f"{(self.first_token - self.started) * 1e3:.1f}"
        e2e = (time.perf_counter() - self.started) * 1e3
        return (
            f"Request {self.request_id}: status={self.status} "
            f"prompt_tokens={sum(self.num_prompt.values())} "
            f"completion_tokens={self.num_completion} ttft_ms={ttft} e2e_ms={e2e:.1f}"
            + (" health_probe" if self.probe else "")
        )


class WorkerApp:
    """Handlers over one engine serving one model name."""

    def __init__(
        self,
        engine: AsyncLLMEngine,
        served_name: str,
        log: Callable[[str], None],
        faults: FaultSpec | None = None,
    ) -> None:
        self.engine = engine
        self.faults = Faults(faults)
        self.served_name = served_name
        self.tokenizer = engine.engine.tokenizer
        self.max_model_len: int = engine.engine.max_model_len
        self.max_prompt_bytes = (
            self.max_model_len * self.tokenizer.max_token_bytes * PROMPT_BYTES_MARGIN
        )
        """Text prompts over this many UTF-8 bytes cannot fit ``max_model_len`` tokens."""
        self.tokens = responses.TokenText(self.tokenizer)
        self.log = log
        self.num_active = 0
        self.created = int(time.time())
        self.telemetry = WorkerTelemetry(engine)  # telemetry: served as GET /metrics
        self.embeddings: Embeddings
        """``POST /v1/embeddings``, and the task check of chat and completions (set by
        :func:`create_worker_app`)."""

    # ---- routes ----
    async def chat_completions(self, request: Request) -> Response:
        raw = await request.body()
        call = _new_call(request)  # timed from the whole request's arrival
        req = await _off_loop_if_large(raw, parse_request, ChatCompletionRequest, raw)
        self._check_model(req.model)
        self.embeddings.refuse_generation()
        await self.faults.apply(request.headers)
        tools = req.tool_use(self.tokenizer.chat_template)
        params = tools.sampling(req.to_sampling_params())  # tool_choice required or named
        messages = tools.messages([m.template_dict() for m in req.messages])
        prompt = await _off_loop_if_large(
            raw, self._chat_prompt, messages, tools.template_variables()
        )
        submitted = await self._submit([prompt], params)
        response_id = f"chatcmpl-{uuid.uuid4().hex}"
        if req.stream:
            events = self._chat_events(
                call, req, response_id, submitted.streams, params.logprobs, tools
            )
            return self._sse(call, submitted, events)
        outputs = await self._collect(request, call, submitted)
        if outputs is None:
            return self._finish(call, Response(status_code=CLIENT_GONE))
        body = responses.chat_completion(
            response_id, req.model, outputs[0], self.tokens, params.logprobs
        )
        for choice, output in zip(body["choices"], outputs[0].outputs, strict=True):
            choice["message"], choice["finish_reason"] = tools.answer(
                output.text, output.finish_reason
            )
        return self._finish(call, _json(call, body))

    async def completions(self, request: Request) -> Response:
        raw = await request.body()
        call = _new_call(request)  # timed from the whole request's arrival
        req = await _off_loop_if_large(raw, parse_request, CompletionRequest, raw)
        self._check_model(req.model)
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
            prompts = await _off_loop_if_large(raw, self._encode_all, prompts)
            for prompt in prompts:  # the engine would check each id of a long one first
                self.check_prompt(prompt)
        submitted = await self._submit(prompts, params)
        response_id = f"cmpl-{uuid.uuid4().hex}"
        if req.stream:
            events = self._completion_events(
                call, req, response_id, submitted.streams, params.logprobs, echo_texts
            )
            return self._sse(call, submitted, events)
        outputs = await self._collect(request, call, submitted)
        if outputs is None:
            return self._finish(call, Response(status_code=CLIENT_GONE))
        body = responses.text_completion(
            response_id, req.model, outputs, self.tokens, params.logprobs, echo_texts
        )
        return self._finish(call, _json(call, body))

    async def tokenize(self, request: Request) -> dict[str, Any]:
        """``POST /tokenize``: the token ids a prompt (or chat) would be given, as the
        completions and chat routes encode it."""
        raw = await request.body()
        req = (await _off_loop_if_large(raw, parse_request, TokenizeRequest, raw)).checked()
        self._check_model(req.model)
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
        req = await _off_loop_if_large(raw, parse_request, DetokenizeRequest, raw)
        self._check_model(req.model)
        budgets.require("detokenize_ids", "tokens", len(req.tokens))
        vocab = self.engine.engine.vocab_size
        if max(req.tokens, default=0) >= vocab:
            bad = next(i for i, t in enumerate(req.tokens) if t >= vocab)
            raise param_error(
                f"tokens.{bad}", f"token {req.tokens[bad]} is not an id of this model (< {vocab})"
            )
        return {"prompt": await _off_loop_if_large(raw, self.tokenizer.decode, req.tokens, False)}

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
        call = _new_call(request)
        call.status = status
        self.log(call.log_line())
        self.telemetry.observe(call)  # telemetry
        headers[http_headers.REQUEST_ID] = call.request_id
        return JSONResponse(body, status_code=status, headers=headers)

    def check_prompt(self, prompt: Prompt) -> None:
        """Raise :class:`PromptTooLong` for a prompt that surely cannot fit ``max_model_len``
        (a text over :attr:`max_prompt_bytes`, a token list of ``max_model_len`` or more),
        without tokenizing it; cheap (no pass over a text under the bound in characters)."""
        if isinstance(prompt, str):
            if len(prompt) > self.max_prompt_bytes or (  # a character is at least one byte
                len(prompt) * 4 > self.max_prompt_bytes
                and len(prompt.encode("utf-8", "surrogatepass")) > self.max_prompt_bytes
            ):
                self._too_long(f"{len(prompt)}-character")
        elif len(prompt) >= self.max_model_len:
            raise PromptTooLong(
                f"prompt has {len(prompt)} tokens but the max_model_len is {self.max_model_len} "
                "tokens; the prompt must leave room for at least one output token",
                hint="shorten the prompt",
            )

    # ---- internals ----
    def _too_long(self, what: str) -> None:
        raise PromptTooLong(
            f"the {what} prompt cannot fit max_model_len = {self.max_model_len} tokens: "
            f"it is over {self.max_prompt_bytes} bytes of UTF-8 (max_model_len x "
            f"{self.tokenizer.max_token_bytes} bytes, the longest token of this model, x "
            f"{PROMPT_BYTES_MARGIN}), so it was refused without tokenizing it",
            hint="shorten the prompt",
        )

    def _chat_prompt(
        self, messages: list[dict[str, Any]], variables: dict[str, Any] | None = None
    ) -> list[int]:
        """The token ids of ``messages`` through the chat template (given ``variables``)."""
        text = self.tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, **(variables or {})
        )
        self.check_prompt(text)
        self._refuse_if_surely_over(text)
        prompt = self.tokenizer.encode(text, add_special_tokens=False)
        self.check_prompt(prompt)
        return prompt

    def _encode_all(self, prompts: Sequence[Prompt]) -> list[Prompt]:
        """Text prompts as token ids, as the engine would encode them."""
        for prompt in prompts:
            if isinstance(prompt, str):
                self._refuse_if_surely_over(prompt)
        return [self.tokenizer.encode(p) if isinstance(p, str) else p for p in prompts]

    def _refuse_if_surely_over(self, text: str) -> None:
        """Raise :class:`PromptTooLong` for a long text whose leading pieces already hold
        more tokens than ``max_model_len`` (with 10 % to spare): a prompt of 1.25 MB, under
        the byte bound, took 16 s to tokenize only to be refused; its first ~40 kB decide.
        Pieces are cut before a space (where pre-tokenizers cut too), so their counts add up
        to the whole's; texts under four characters per token of the bound are not looked at."""
        bound = self.max_model_len + self.max_model_len // 10 + 64
        if len(text) <= 4 * bound:
            return
        count = start = 0
        while start < len(text):
            end = min(len(text), start + SURE_PIECE_CHARS)
            if end < len(text):
                space = text.rfind(" ", start + SURE_PIECE_CHARS // 2, end)
                end = space if space > start else end
            count += len(self.tokenizer.encode(text[start:end], add_special_tokens=False))
            if count > bound:
                raise PromptTooLong(
                    f"the {len(text)}-character prompt cannot fit max_model_len = "
                    f"{self.max_model_len} tokens: its first {end} characters are already "
                    f"{count} tokens, so the rest was not tokenized",
                    hint="shorten the prompt",
                )
            start = end

    def _check_model(self, model: str) -> None:
        if model != self.served_name:
            raise ModelNotFound(
                f"model {model!r} is not served here; served models: {self.served_name}"
            )

    async def _submit(self, prompts: Sequence[Prompt], params: SamplingParams) -> _Submitted:
        """Queue one engine request per prompt; if one is rejected, abort the others."""
        submitted = _Submitted([], [])
        try:
            for prompt in prompts:
                request_id = uuid.uuid4().hex
                if params.guide is None:
                    stream = self.engine.add_request(prompt, params, request_id)
                else:  # its grammar compiles off the event loop, within the program budget
                    request = await budgets.bounded(
                        params.guide.field, self.engine.engine.make_request, prompt, params,
                        request_id,
                    )  # fmt: skip
                    stream = self.engine.add(request)
                submitted.streams.append(stream)
                submitted.request_ids.append(request_id)
        except BaseException:
            await self._abort(submitted)
            raise
        return submitted

    async def _abort(self, submitted: _Submitted) -> None:
        """Abort the requests (a no-op for finished ones): an iterator that was never
        started would otherwise leave its request running."""
        for request_id in submitted.request_ids:
            await self.engine.abort(request_id)

    async def _collect(
        self, request: Request, call: _Call, submitted: _Submitted
    ) -> list[RequestOutput] | None:
        """Every request's final output; None when the client left first (then the
        generations are aborted)."""

        async def one(index: int, stream: AsyncIterator[RequestOutputDelta]) -> RequestOutput:
            async for delta in stream:
                call.observe(index, delta)
                if delta.final is not None:
                    return delta.final
            raise EngineError("the engine ended a request without its output")

        async def every() -> list[RequestOutput]:
            work = [one(i, s) for i, s in enumerate(submitted.streams)]
            return [await work[0]] if len(work) == 1 else list(await asyncio.gather(*work))

        self.num_active += 1
        try:
            result = await _unless_disconnected(request, every())
        except Exception:  # one request failed: stop the others of this call too
            await self._abort(submitted)
            raise
        finally:
            self.num_active -= 1
        if result is None:
            call.status = CLIENT_GONE
            await self._abort(submitted)
        return result

    def _finish(self, call: _Call, response: Response) -> Response:
        self.log(call.log_line())
        self.telemetry.observe(call)  # telemetry
        return response

    def _sse(self, call: _Call, submitted: _Submitted, events: AsyncIterator[bytes]) -> Response:
        return _EventStream(self, call, submitted, events)

    async def _chat_events(
        self,
        call: _Call,
        req: ChatCompletionRequest,
        response_id: str,
        streams: list[AsyncIterator[RequestOutputDelta]],
        top_k: int | None,
        tools: ToolUse,
    ) -> AsyncIterator[bytes]:
        created, with_usage = int(time.time()), req.include_usage
        started: set[int] = set()
        calls = _ToolCallDeltas(tools)
        async for _, delta in self._deltas(call, streams):
            wants_logprobs = top_k is not None and bool(delta.logprobs)
            text, tool_calls, finish_reason = calls.read(delta)
            if not (text or tool_calls or finish_reason or wants_logprobs):
                continue  # text held back (partial character, stop string, call)
            message: dict[str, Any] = {"content": text}
            if delta.index not in started:
                started.add(delta.index)
                message = {"role": "assistant", "content": text}
            if tool_calls:
                message["content"] = text or None
                message["tool_calls"] = tool_calls
            logprobs = None
            if wants_logprobs:
                logprobs = responses.chat_logprobs(
                    self.tokens, delta.token_ids, delta.logprobs or [], top_k or 0
                )
            choice = {"index": delta.index, "delta": message, "logprobs": logprobs,
                      "finish_reason": finish_reason}  # fmt: skip
            running = call.usage() if req.continuous_usage else None
            yield sse.event(responses.chunk(response_id, "chat.completion.chunk", created,
                                            req.model, [choice], running, with_usage))  # fmt: skip
        if with_usage:
            body = responses.chunk(response_id, "chat.completion.chunk", created, req.model, [],
                                   call.usage(), True)  # fmt: skip
            yield sse.event(body)
        yield sse.DONE

    async def _completion_events(
        self,
        call: _Call,
        req: CompletionRequest,
        response_id: str,
        streams: list[AsyncIterator[RequestOutputDelta]],
        top_k: int | None,
        echo_texts: list[str] | None,
    ) -> AsyncIterator[bytes]:
        created, with_usage = int(time.time()), req.include_usage
        offsets: dict[int, int] = {}
        async for prompt_index, delta in self._deltas(call, streams):
            index = prompt_index * req.n + delta.index
            text = delta.text
            if echo_texts is not None and index not in offsets:
                text = echo_texts[prompt_index] + text
            wants_logprobs = top_k is not None and bool(delta.logprobs)
            if not (text or delta.finish_reason or wants_logprobs):
                continue
            offset = offsets.get(index, 0)
            offsets[index] = offset + len(text)
            logprobs = None
            if wants_logprobs:
                logprobs = responses.completion_logprobs(
                    self.tokens, delta.token_ids, delta.logprobs or [], top_k or 0,
                    offset + len(text) - len(delta.text),
                )  # fmt: skip
            choice = {"index": index, "text": text, "logprobs": logprobs,
                      "finish_reason": delta.finish_reason}  # fmt: skip
            running = call.usage() if req.continuous_usage else None
            yield sse.event(responses.chunk(
                response_id, "text_completion", created, req.model, [choice], running, with_usage
            ))  # fmt: skip
        if with_usage:
            yield sse.event(responses.chunk(
                response_id, "text_completion", created, req.model, [], call.usage(), True
            ))  # fmt: skip
        yield sse.DONE

    async def _deltas(
        self, call: _Call, streams: list[AsyncIterator[RequestOutputDelta]]
    ) -> AsyncIterator[tuple[int, RequestOutputDelta]]:
        """Every stream's deltas tagged with its prompt index, as they come; counted in
        ``call``. Closing this iterator closes the streams (which aborts them)."""
        self.num_active += 1
        try:
            async for index, delta in _merge(streams):
                call.observe(index, delta)
                yield index, delta
        finally:
            self.num_active -= 1


class _ToolCallDeltas:
    """Reads each streamed choice for tool calls: text that may start a call is held back,
    each call is sent whole as one ``tool_calls`` delta once written."""

    def __init__(self, tools: ToolUse) -> None:
        self.tools = tools
        self.streams: dict[int, ToolStream | None] = {}
        self.sent: dict[int, int] = {}
        self.seen: set[tuple[int, str]] = set()
        """(choice, :attr:`ToolCall.key`) of the calls sent: where calls may follow each
        other, a repeat that was streamed before the engine ended the answer at it is not
        sent."""

    def read(self, delta: RequestOutputDelta) -> tuple[str, list[dict[str, Any]], str | None]:
        """``(content, tool-call deltas, finish reason)`` of one engine delta."""
        index = delta.index
        if index not in self.streams:
            self.streams[index] = self.tools.stream()
        stream = self.streams[index]
        if stream is None:
            return delta.text, [], delta.finish_reason
        text, calls = stream.feed(delta.text)
        if delta.finish_reason is not None:
            rest, more = stream.finish(cut=self.tools.cut(delta.finish_reason))
            text, calls = text + rest, calls + more
        if self.tools.several_calls:
            calls = [c for c in calls if (index, c.key) not in self.seen]
            self.seen.update((index, c.key) for c in calls)
        first = self.sent.get(index, 0)
        self.sent[index] = first + len(calls)
        finish = delta.finish_reason
        if finish == "stop" and self.sent[index]:
            finish = "tool_calls"
        return text, [c.openai(first + k) for k, c in enumerate(calls)], finish


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
    from kunlun.serving.embeddings import Embeddings  # it builds on this module

    worker = WorkerApp(engine, served_name, log, faults)
    worker.embeddings = Embeddings(worker, task, pooling)
    app = FastAPI(title="Kunlun engine worker", docs_url=None, redoc_url=None)
    app.state.worker = worker
    app.post("/v1/chat/completions")(worker.chat_completions)
    app.post("/v1/completions")(worker.completions)
    app.post("/v1/embeddings")(worker.embeddings)
    app.get("/v1/models")(worker.models)
    app.post("/tokenize")(worker.tokenize)
    app.post("/detokenize")(worker.detokenize)
    add_sglang_routes(app, worker)  # SGLang's native API
    app.get("/health")(worker.health)
    app.get("/stats")(worker.stats)
    app.get("/metrics")(worker.telemetry.metrics)  # telemetry
    app.add_exception_handler(KunlunError, worker.error)
    app.add_exception_handler(Exception, worker.error)
    return app


# ---- helpers ----
@dataclasses.dataclass
class _Submitted:
    """The engine requests of one API call (one per prompt) and their delta streams."""

    request_ids: list[str]
    streams: list[AsyncIterator[RequestOutputDelta]]


class _EventStream(StreamingResponse):
    """An SSE response over engine requests. However it ends (done, failed, client gone
    before or during the stream), its requests are ended and the call is logged once."""

    def __init__(
        self, worker: WorkerApp, call: _Call, submitted: _Submitted, events: AsyncIterator[bytes]
    ) -> None:
        headers = {http_headers.REQUEST_ID: call.request_id, "Cache-Control": "no-cache"}
        super().__init__(self._relay(events), media_type=sse.MEDIA_TYPE, headers=headers)
        self.worker, self.call, self.submitted = worker, call, submitted
        self.completed = False

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            if not self.completed:
                self.call.status = CLIENT_GONE
                await self.worker._abort(self.submitted)
            self.worker.log(self.call.log_line())
            self.worker.telemetry.observe(self.call)  # telemetry

    async def _relay(self, events: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
        try:
            async for event in events:
                yield event
            self.completed = True
        except Exception as exc:  # the engine failed this request: tell the client, go on
            self.call.status = error_status_and_body(exc)[0]
            self.completed = True
            yield sse.error_event(exc)
        finally:
            await events.aclose()  # type: ignore[attr-defined]


async def _off_loop_if_large(raw: bytes, function: Callable[..., _T], *args: Any) -> _T:
    """``function(*args)``, in a thread when ``raw`` (the body it reads) is large."""
    if len(raw) > _THREAD_BODY_BYTES:
        return await asyncio.to_thread(function, *args)
    return function(*args)


def _new_call(request: Request) -> _Call:
    return _Call(
        request.headers.get(http_headers.REQUEST_ID) or uuid.uuid4().hex,
        probe=bool(request.headers.get(PROBE_HEADER)),
    )


def _json(call: _Call, body: dict[str, Any]) -> Response:
    return Response(sse.dumps(body), media_type="application/json",
                    headers={http_headers.REQUEST_ID: call.request_id})  # fmt: skip


async def _merge(
    streams: list[AsyncIterator[RequestOutputDelta]],
) -> AsyncIterator[tuple[int, RequestOutputDelta]]:
    """Interleave the streams' items as they arrive, each tagged with its stream's index."""
    if len(streams) == 1:
        try:
            async for delta in streams[0]:
                yield 0, delta
        finally:
            await streams[0].aclose()  # type: ignore[attr-defined]
        return
    queue: asyncio.Queue[tuple[int, RequestOutputDelta | None] | BaseException] = asyncio.Queue()

    async def pump(index: int, stream: AsyncIterator[RequestOutputDelta]) -> None:
        try:
            async for delta in stream:
                queue.put_nowait((index, delta))
            queue.put_nowait((index, None))
        except Exception as exc:
            queue.put_nowait(exc)

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            item = await queue.get()
            if isinstance(item, BaseException):
                raise item
            if item[1] is None:
                remaining -= 1
                continue
            yield item  # type: ignore[misc]
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _unless_disconnected(request: Request, work: Awaitable[_T]) -> _T | None:
    """Await ``work``, or cancel it and return None as soon as the client disconnects."""
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(_wait_disconnect(request))
    try:
        await asyncio.wait((task, watch), return_when=asyncio.FIRST_COMPLETED)
    except BaseException:  # cancelled ourselves
        task.cancel()
        watch.cancel()
        raise
    watch.cancel()
    if task.done():
        return task.result()
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    return None


async def _wait_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass
