"""SGLang's native API on the engine worker: ``/generate``, ``/get_model_info``,
``/get_server_info`` and ``/flush_cache``.

The handlers ride on :class:`~kunlun.serving.worker_core.WorkerCore`: the same prompt checks,
submission, disconnect handling, streaming response (an SSE stream that fails ends with one
error event) and request log as the OpenAI routes, only the request and response shapes
differ (:mod:`kunlun.protocol.sglang`). A streamed ``/generate`` sends, for each new
piece of a completion, ``data: {"text": <all its text so far>, "meta_info": {...}}`` (plus
``"index"`` when the answer is a list), then ``data: [DONE]``, as SGLang does; the input
logprobs, known once the request ends, come with its last event.

``/flush_cache`` forgets the engine's prefix cache between two steps, and, as SGLang does,
refuses (400) while requests are running or waiting. The two info routes answer ``GET``
(SGLang's method) and ``POST`` (how the daemon's gateway forwards them).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from fastapi.responses import PlainTextResponse, Response

import kunlun
from kunlun.engine.launch import EMBEDDED_ENGINE
from kunlun.engine.outputs import CompletionOutput, RequestOutput
from kunlun.engine.sampling_params import SamplingParams
from kunlun.errors import RequestError
from kunlun.limits import CLIENT_GONE
from kunlun.protocol import sse
from kunlun.protocol.openai_errors import param_error
from kunlun.protocol.request_body import parse_request
from kunlun.protocol.sglang import (
    GenerateRequest,
    chat_template_family,
    finish_reason,
    generate_item,
)
from kunlun.protocol.sglang import logprob_fields as _logprob_fields
from kunlun.serving.worker_calls import Call, json_response, new_call, off_loop_if_large

if TYPE_CHECKING:  # the worker's engine imports torch, which the daemon's gateway does not load
    from kunlun.serving.worker_core import WorkerCore

FLUSHED = "Cache flushed.\n"
"""The body of a successful ``/flush_cache`` (plain text, as SGLang answers)."""


class SGLangRoutes:
    """SGLang's native routes over one worker."""

    def __init__(self, worker: WorkerCore) -> None:
        self.worker = worker

    async def generate(self, request: Request) -> Response:
        worker = self.worker
        raw = await request.body()
        call = new_call(request)
        req = await off_loop_if_large(raw, parse_request, GenerateRequest, raw)
        if req.model is not None:
            worker.check_model(req.model)
        await worker.faults.apply(request.headers)
        params = req.to_sampling_params()
        prompts = req.prompts()
        for prompt in prompts:
            worker.check_prompt(prompt)
        if any(isinstance(p, str) for p in prompts):
            prompts = await off_loop_if_large(raw, worker.encode_all, prompts)
            for prompt in prompts:
                worker.check_prompt(prompt)
        field = "text" if req.text is not None else "input_ids"
        for i, prompt in enumerate(prompts):
            if not prompt:
                raise param_error(field, f"prompt {i} has no tokens")
            if req.return_logprob and req.logprob_start_len >= len(prompt):
                raise param_error("logprob_start_len",
                                  f"logprob_start_len={req.logprob_start_len} is not a position "
                                  f"of prompt {i}, which has {len(prompt)} tokens")  # fmt: skip
        submitted = await worker.submit(prompts, params)
        rids = [r or uuid.uuid4().hex for r in req.rids()]
        if req.stream:
            return worker.sse(call, submitted, self._events(call, req, rids, submitted.streams))
        outputs = await worker.collect(request, call, submitted)
        if outputs is None:
            return worker.finish(call, Response(status_code=CLIENT_GONE))
        latency = time.perf_counter() - call.started
        items = [
            generate_item(req, worker.tokens, _rid(rids[i], req, o), final, o, latency)
            for i, final in enumerate(outputs)
            for o in final.outputs
        ]
        body: Any = items if req.lists_answer else items[0]
        return worker.finish(call, json_response(call, body))

    async def get_model_info(self) -> dict[str, Any]:
        """SGLang's model info; ``model_path`` is the served model's name (the platform does
        not expose its file system paths), ``chat_template`` the SGLang front-end template
        that writes turns as the model's own template does (the front-end cannot guess it
        from an alias: ``RuntimeEndpoint(url, chat_template_name=...)`` takes it)."""
        worker = self.worker
        architecture = getattr(getattr(worker.engine.engine.runner, "config", None),
                               "architecture", None)  # fmt: skip
        return {
            "model_path": worker.served_name,
            "tokenizer_path": worker.served_name,
            "served_model_name": worker.served_name,
            "is_generation": True,
            "preferred_sampling_params": None,
            "weight_version": "default",
            "has_image_understanding": False,
            "has_audio_understanding": False,
            "architectures": None if architecture is None else [architecture],
            "chat_template": chat_template_family(worker.tokenizer.chat_template),
        }

    async def get_server_info(self) -> dict[str, Any]:
        """What the engine runs with, under SGLang's server-argument names where one fits."""
        worker = self.worker
        engine = worker.engine.engine
        config = engine.config
        stats = worker.engine.stats()
        return {
            "version": kunlun.__version__,
            "engine": EMBEDDED_ENGINE,
            "model_path": worker.served_name,
            "served_model_name": worker.served_name,
            "context_length": worker.max_model_len,
            "max_running_requests": config.max_num_seqs,
            "chunked_prefill_size": config.max_num_batched_tokens,
            "page_size": engine.block_manager.block_size,
            "max_total_num_tokens": stats.num_blocks_total * engine.block_manager.block_size,
            "disable_radix_cache": not config.enable_prefix_caching,
            "tp_size": config.tensor_parallel_size,
            "device": str(config.device),
            "dtype": str(config.dtype).removeprefix("torch."),
            "quantization": config.quantization,
            "random_seed": config.seed,
            "num_running_requests": stats.num_running,
            "num_waiting_requests": stats.num_waiting,
        }

    async def health_generate(self) -> Response:
        """SGLang's ``/health_generate``: 200 once the engine has generated a token (a
        worker whose engine is stuck or broken does not answer, or answers 5xx)."""
        tokenizer = self.worker.tokenizer
        probe = next((t for t in (tokenizer.bos_token_id, tokenizer.eos_token_id)
                      if t is not None), 0)  # fmt: skip
        params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
        submitted = await self.worker.submit([[probe]], params)
        for stream in submitted.streams:
            async for _ in stream:
                pass
        return Response(status_code=200)

    async def flush_cache(self) -> Response:
        """Forget the prefix cache; 400 while requests are running or waiting."""
        busy = await self.worker.engine.flush_prefix_cache()
        if busy:
            raise RequestError(
                f"cache not flushed: {busy} request(s) are running or waiting",
                hint="retry when the engine is idle",
            )
        return PlainTextResponse(FLUSHED)

    async def _events(
        self,
        call: Call,
        req: GenerateRequest,
        rids: list[str],
        streams: list[AsyncIterator[Any]],
    ) -> AsyncIterator[bytes]:
        texts: dict[tuple[int, int], str] = {}
        ids: dict[tuple[int, int], list[int]] = {}
        entries: dict[tuple[int, int], list[Any]] = {}
        n = req.sampling_params.n
        prefill_only = req.sampling_params.max_new_tokens == 0
        async for prompt_index, delta in self.worker.deltas(call, streams):
            key = (prompt_index, delta.index)
            if not prefill_only:
                texts[key] = texts.get(key, "") + delta.text
                ids.setdefault(key, []).extend(delta.token_ids)
                entries.setdefault(key, []).extend(delta.logprobs or [])
            if not (delta.finish_reason or (delta.text and not prefill_only)):
                continue  # text held back (partial character or stop string)
            output = CompletionOutput(delta.index, texts.get(key, ""), ids.get(key, []),
                                      delta.finish_reason)  # fmt: skip
            final = delta.final
            if final is not None:
                output = next((o for o in final.outputs if o.index == delta.index), output)
            meta: dict[str, Any] = {
                "id": _rid(rids[prompt_index], req, output),
                "finish_reason": finish_reason(output, req.sampling_params.max_new_tokens),
                "prompt_tokens": delta.num_prompt_tokens,
                "completion_tokens": len(ids.get(key, [])),
                "cached_tokens": delta.num_cached_tokens,
                "e2e_latency": time.perf_counter() - call.started,
            }
            if req.return_logprob:
                prompt_ids, prompt_logprobs = _prompt_of(final)
                meta.update(_logprob_fields(req, self.worker.tokens, prompt_ids, prompt_logprobs,
                                            ids.get(key, []), entries.get(key, [])))  # fmt: skip
            chunk: dict[str, Any] = {"text": texts.get(key, ""), "meta_info": meta}
            if req.lists_answer:
                chunk["index"] = prompt_index * n + delta.index
            yield sse.event(chunk)
        yield sse.DONE


def _prompt_of(final: RequestOutput | None) -> tuple[list[int], Any]:
    if final is None:
        return [], None
    return final.prompt_token_ids, final.prompt_logprobs


def _rid(rid: str, req: GenerateRequest, output: CompletionOutput) -> str:
    """The id of one completion: the prompt's ``rid``, suffixed with the index when n > 1."""
    return rid if req.sampling_params.n == 1 else f"{rid}-{output.index}"


def add_sglang_routes(app: FastAPI, worker: WorkerCore) -> None:
    """Register SGLang's native routes on the worker's app."""
    routes = SGLangRoutes(worker)
    app.post("/generate")(routes.generate)
    for path, handler in (("/get_model_info", routes.get_model_info),
                          ("/get_server_info", routes.get_server_info),
                          ("/flush_cache", routes.flush_cache),
                          ("/health_generate", routes.health_generate)):  # fmt: skip
        app.get(path)(handler)
        app.post(path, include_in_schema=False)(handler)
