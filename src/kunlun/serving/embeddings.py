"""``POST /v1/embeddings`` on the engine worker, in OpenAI's request and response shapes.

A worker answers it when its model is served for embeddings (``task: embed``); a worker
serving its model for generation refuses it with a 400 naming ``model`` (and, the other way
round, :meth:`Embeddings.refuse_generation` is how chat and completions refuse an embedding
model). ``input`` is a string, a list of strings, a list of token ids or a list of such
lists; each becomes one vector (:mod:`kunlun.engine.pooling`), in order. Strings are encoded
as the completions route encodes a prompt (the tokenizer's special tokens added).

``encoding_format`` ``float`` (a JSON list) or ``base64`` (the vector's little-endian float32
bytes, what OpenAI's SDK asks for by default and decodes). ``dimensions`` is accepted when it
is the model's embedding size; a smaller one only when the model's ``config.json`` declares
Matryoshka training (``matryoshka_dimensions``: the sizes it was trained for, or
``is_matryoshka: true``: any size), and the vector is then cut to it and normalised again.
``user`` is accepted and ignored, as on every route (:data:`kunlun.protocol.fields
.IGNORED_FIELDS`). Every bad input is a 400 naming its field: an empty input, an input longer
than the model takes (``input`` or ``input.3``, with the limit), a token id outside the
vocabulary, more than :data:`MAX_INPUTS` inputs.
"""

from __future__ import annotations

import base64
import json
from pathlib import Path

import torch
import torch.nn.functional as F
from fastapi import Request
from fastapi.responses import Response

from kunlun.engine.launch import Pooling, Task
from kunlun.engine.pooling import check_input, input_limit
from kunlun.errors import Location, PromptTooLong, RequestError
from kunlun.protocol.embedding_request import EmbeddingRequest, served_for_generation
from kunlun.protocol.openai_errors import param_error
from kunlun.protocol.request_body import parse_request
from kunlun.serving.worker_calls import Call, json_response, new_call, off_loop_if_large
from kunlun.serving.worker_core import PROMPT_BYTES_MARGIN, WorkerCore

MAX_INPUTS = 2048
"""Inputs one request may hold (OpenAI's limit)."""


def matryoshka_dimensions(model_dir: str | Path, size: int) -> set[int] | None:
    """The sizes a model's vectors may be cut to, from its ``config.json`` (None: any size
    up to ``size``; an empty set: none but ``size``)."""
    path = Path(model_dir) / "config.json"
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError):
        return set()
    declared = raw.get("matryoshka_dimensions")
    if isinstance(declared, list):
        return {d for d in declared if isinstance(d, int) and 0 < d <= size}
    return None if raw.get("is_matryoshka") is True else set()


class Embeddings:
    """The embeddings route of one worker, and the task check of its other routes."""

    def __init__(self, worker: WorkerCore, task: Task, pooling: Pooling) -> None:
        self.worker = worker
        self.task = task
        self.pooling: Pooling = pooling
        engine = worker.engine.engine
        self.size: int = engine.runner.config.hidden_size
        """The model's embedding size (its hidden size)."""
        self.cuts = matryoshka_dimensions(engine.config.model_dir, self.size)

    def refuse_generation(self) -> None:
        """Chat and completions on a model served for embeddings: a 400 naming ``model``."""
        if self.task == "embed":
            raise param_error(
                "model",
                f"model {self.worker.served_name!r} is served for embeddings (task embed): "
                "it answers /v1/embeddings only; serve it again without --task embed for chat "
                "and completions",
            )

    async def __call__(self, request: Request) -> Response:
        raw = await request.body()
        call = new_call(request)  # logged and counted like the other routes
        req = await off_loop_if_large(raw, parse_request, EmbeddingRequest, raw)
        vectors = await self.vectors(request, raw, req, call)
        data = [
            {"object": "embedding", "index": i, "embedding": _encode(v, req.encoding_format)}
            for i, v in enumerate(vectors)
        ]
        num_tokens = sum(call.num_prompt.values())
        body = {"object": "list", "data": data, "model": req.model,
                "usage": {"prompt_tokens": num_tokens, "total_tokens": num_tokens}}  # fmt: skip
        return self.worker.finish(call, json_response(call, body))

    async def vectors(
        self, request: Request, raw: bytes, req: EmbeddingRequest, call: Call
    ) -> list[torch.Tensor]:
        """The request's vectors, in order, each cut to ``dimensions`` where asked; its
        inputs' token counts are recorded in ``call``."""
        self.worker.check_model(req.model)
        if self.task != "embed":
            raise served_for_generation(req.model)
        await self.worker.faults.apply(request.headers)
        cut = self._dimensions(req.dimensions)
        inputs = await off_loop_if_large(raw, self._token_ids, req)
        vectors = await self.worker.engine.embed(inputs, self.pooling)
        call.num_prompt = {i: len(ids) for i, ids in enumerate(inputs)}
        return [_cut(v, cut) for v in vectors]

    def _dimensions(self, dimensions: int | None) -> int | None:
        """The size to cut vectors to (None: the model's), or a 400 naming ``dimensions``."""
        if dimensions is None or dimensions == self.size:
            return None
        cuts = self.cuts
        if dimensions < self.size and (cuts is None or dimensions in cuts):
            return dimensions
        allowed = (f"any size up to {self.size}" if cuts is None else
                   ", ".join(str(d) for d in sorted(cuts | {self.size})))  # fmt: skip
        raise param_error(
            "dimensions",
            f"dimensions={dimensions} is not a size this model's embeddings have: it gives "
            f"{allowed} (a smaller size only for a model its config.json declares Matryoshka-"
            "trained, matryoshka_dimensions)",
        )

    def _token_ids(self, req: EmbeddingRequest) -> list[list[int]]:
        """Each input's token ids, checked; a 400 naming the input that is refused."""
        inputs = req.inputs()
        if not inputs:
            raise param_error("input", "input is empty: give at least one string or token list")
        if len(inputs) > MAX_INPUTS:
            raise param_error(
                "input", f"input holds {len(inputs)} inputs; at most {MAX_INPUTS} per request"
            )
        engine = self.worker.engine.engine
        limit, what = input_limit(engine)
        max_chars = limit * self.worker.tokenizer.max_token_bytes * PROMPT_BYTES_MARGIN
        result = []
        for i, item in enumerate(inputs):
            name = "input" if req.single else f"input.{i}"
            try:
                if isinstance(item, str):
                    if not item:
                        raise RequestError("the input is an empty string")
                    if len(item) > max_chars:  # surely too long: refused without encoding it
                        raise PromptTooLong(
                            f"the input has {len(item)} characters, more than the {what} of "
                            f"{limit} tokens can hold (at most {max_chars} characters)",
                            hint="shorten the input, or split it into several inputs",
                        )
                    item = self.worker.tokenizer.encode(item)
                check_input(engine, item)
            except RequestError as exc:
                exc.location = Location("request", field=name)
                exc.args = (str(exc),)
                raise
            result.append(item)
        return result


def _cut(vector: torch.Tensor, cut: int | None) -> torch.Tensor:
    """``vector`` cut (and normalised again) to ``cut`` dimensions when given."""
    return vector if cut is None else F.normalize(vector[:cut], dim=0)


def _encode(vector: torch.Tensor, encoding: str) -> list[float] | str:
    """One vector in the response: a list of floats, or base64 of its little-endian float32
    bytes."""
    if encoding == "base64":
        return base64.b64encode(vector.numpy().astype("<f4").tobytes()).decode("ascii")
    return vector.tolist()
