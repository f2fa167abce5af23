"""What the engine worker's route sets share: :class:`WorkerCore`, over one
:class:`AsyncLLMEngine` serving one model name.

The OpenAI routes (:class:`~kunlun.serving.worker_app.WorkerApp`, which extends it), SGLang's
native ones (:mod:`kunlun.serving.sglang_api`) and the embeddings route
(:mod:`kunlun.serving.embeddings`) differ only in their request and response shapes; this is
the rest. A text prompt that cannot fit the context is refused before it is tokenized
(:meth:`WorkerCore.check_prompt`), and one whose first pieces already hold too many tokens
before the rest is (:meth:`WorkerCore.chat_prompt`, :meth:`WorkerCore.encode_all`, which the
routes run in a thread for a large body, so that a long prompt does not stall the event loop
other requests stream on). Each prompt becomes one engine request (:meth:`WorkerCore.submit`);
a client that goes away aborts its generations (the engine frees their KV blocks), whether it
waits for the whole answer (:meth:`WorkerCore.collect`) or streams it (:class:`EventStream`);
a request that fails while streaming ends with one SSE error event and no ``[DONE]``. One line
per finished request is logged through the ``log`` callable (the worker prints it to stdout
for the node agent), and counted in the worker's metrics.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any, TypeVar

from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from kunlun import budgets
from kunlun import headers as http_headers
from kunlun.engine.async_engine import AsyncLLMEngine
from kunlun.engine.launch import FaultSpec
from kunlun.engine.outputs import RequestOutput, RequestOutputDelta
from kunlun.engine.sampling_params import SamplingParams
from kunlun.errors import EngineError, PromptTooLong
from kunlun.limits import CLIENT_GONE
from kunlun.protocol import responses, sse
from kunlun.protocol.openai_api import ChatCompletionRequest, CompletionRequest, Prompt
from kunlun.protocol.openai_errors import ModelNotFound, error_status_and_body
from kunlun.protocol.tools import ToolUse
from kunlun.serving.faults import Faults
from kunlun.serving.worker_calls import Call
from kunlun.telemetry.worker_metrics import WorkerTelemetry  # telemetry

_T = TypeVar("_T")
SURE_PIECE_CHARS = 16_384
"""Characters tokenized at a time to learn that a long prompt cannot fit."""
PROMPT_BYTES_MARGIN = 2
"""A text prompt longer than ``max_model_len x max_token_bytes x PROMPT_BYTES_MARGIN`` UTF-8
bytes is refused without tokenizing it (it cannot fit); the margin covers normalizers that
shrink text."""


class WorkerCore:
    """The engine, the prompt checks, submission, collection and streaming of one worker."""

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
        self.token_ids = responses.TokenIdNames(self.tokenizer)
        self.log = log
        self.num_active = 0
        self.created = int(time.time())
        self.telemetry = WorkerTelemetry(engine, served_name)  # telemetry: served as GET /metrics

    def tokens_for(self, request: ChatCompletionRequest | CompletionRequest) -> responses.TokenText:
        """How a request's logprobs name tokens: by text, or by id where it asks
        (``return_tokens_as_token_ids``)."""
        return self.token_ids if request.return_tokens_as_token_ids else self.tokens

    def prompt_logprobs(self, output: RequestOutput, k: int) -> list[dict[str, Any] | None]:
        """vLLM's ``prompt_logprobs`` of one prompt (:func:`responses.prompt_logprobs`)."""
        entries = output.prompt_logprobs or [None] * len(output.prompt_token_ids)
        return responses.prompt_logprobs(self.tokens, output.prompt_token_ids, entries, k)

    # ---- prompts ----
    def check_model(self, model: str) -> None:
        """A 404 for a request naming a model this worker does not serve."""
        if model != self.served_name:
            raise ModelNotFound(
                f"model {model!r} is not served here; served models: {self.served_name}"
            )

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

    def chat_prompt(
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

    def encode_all(self, prompts: Sequence[Prompt]) -> list[Prompt]:
        """Text prompts as token ids, as the engine would encode them."""
        for prompt in prompts:
            if isinstance(prompt, str):
                self._refuse_if_surely_over(prompt)
        return [self.tokenizer.encode(p) if isinstance(p, str) else p for p in prompts]

    def _too_long(self, what: str) -> None:
        raise PromptTooLong(
            f"the {what} prompt cannot fit max_model_len = {self.max_model_len} tokens: "
            f"it is over {self.max_prompt_bytes} bytes of UTF-8 (max_model_len x "
            f"{self.tokenizer.max_token_bytes} bytes, the longest token of this model, x "
            f"{PROMPT_BYTES_MARGIN}), so it was refused without tokenizing it",
            hint="shorten the prompt",
        )

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

    # ---- engine requests ----
    async def submit(self, prompts: Sequence[Prompt], params: SamplingParams) -> Submitted:
        """Queue one engine request per prompt; if one is rejected, abort the others."""
        submitted = Submitted([], [])
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
            await self.abort(submitted)
            raise
        return submitted

    async def abort(self, submitted: Submitted) -> None:
        """Abort the requests (a no-op for finished ones): an iterator that was never
        started would otherwise leave its request running."""
        for request_id in submitted.request_ids:
            await self.engine.abort(request_id)

    async def collect(
        self, request: Request, call: Call, submitted: Submitted
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
            await self.abort(submitted)
            raise
        finally:
            self.num_active -= 1
        if result is None:
            call.status = CLIENT_GONE
            await self.abort(submitted)
        return result

    async def deltas(
        self, call: Call, streams: list[AsyncIterator[RequestOutputDelta]]
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

    # ---- answers ----
    def finish(self, call: Call, response: Response) -> Response:
        """``response``, once ``call`` is logged and counted."""
        self.log(call.log_line())
        self.telemetry.observe(call)  # telemetry
        return response

    def sse(
        self,
        call: Call,
        submitted: Submitted,
        events: AsyncIterator[bytes],
        media_type: str = sse.MEDIA_TYPE,
        error_event: Callable[[BaseException], bytes] = sse.error_event,
    ) -> Response:
        """The streamed answer of ``call``: ``events`` over the ``submitted`` requests (SSE,
        unless ``media_type`` and ``error_event`` say another framing: Ollama's NDJSON)."""
        return EventStream(self, call, submitted, events, media_type, error_event)


@dataclasses.dataclass
class Submitted:
    """The engine requests of one API call (one per prompt) and their delta streams."""

    request_ids: list[str]
    streams: list[AsyncIterator[RequestOutputDelta]]


StartChat = Callable[
    [Request, bytes, ChatCompletionRequest], Awaitable[tuple[Submitted, ToolUse, SamplingParams]]
]
"""A chat request checked and queued (:meth:`kunlun.serving.worker_app.WorkerApp.start_chat`):
how the other APIs read as a chat (Ollama's, the Responses API) run theirs."""
StartCompletion = Callable[
    [Request, bytes, CompletionRequest],
    Awaitable[tuple[Submitted, SamplingParams, list[str] | None]],
]
"""A text completion checked and queued (``WorkerApp.start_completion``)."""


class EventStream(StreamingResponse):
    """An SSE response over engine requests. However it ends (done, failed, client gone
    before or during the stream), its requests are ended and the call is logged once."""

    def __init__(
        self,
        worker: WorkerCore,
        call: Call,
        submitted: Submitted,
        events: AsyncIterator[bytes],
        media_type: str,
        error_event: Callable[[BaseException], bytes],
    ) -> None:
        headers = {http_headers.REQUEST_ID: call.request_id, "Cache-Control": "no-cache"}
        super().__init__(self._relay(events), media_type=media_type, headers=headers)
        self.worker, self.call, self.submitted = worker, call, submitted
        self.error_event = error_event
        self.completed = False

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            if not self.completed:
                self.call.status = CLIENT_GONE
                await self.worker.abort(self.submitted)
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
            yield self.error_event(exc)
        finally:
            await events.aclose()  # type: ignore[attr-defined]


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
