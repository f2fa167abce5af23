"""``--reference transformers``: the reference column computed by Hugging Face transformers,
outside the platform and its engine, for the numerics and accuracy rows.

:class:`TransformersReference` loads a model directory (Hugging Face layout) with
``AutoModelForCausalLM`` in float32 on the CPU and serves it on a loopback port for the
length of a battery, with the two routes those rows read:

- ``GET /v1/models``: the one model;
- ``POST /v1/completions``: greedy only (``temperature`` 0), a prompt that is a string or a
  list of strings, ``max_tokens``, ``echo`` and ``logprobs`` (up to :data:`MAX_LOGPROBS`),
  answered in the completions API's shape, the token texts spelled as the platform spells
  them (:class:`kunlun.protocol.responses.TokenText`) so that columns compare token by token.

Token ids come from transformers' own tokenizer of the directory. Anything else (another
route, a field it does not honour, sampling) is refused with the error code of a field an
engine lacks, which the battery reports as SKIP with the reason, never as a pass.
"""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from kunlun.errors import ConfigError, EngineLacks, Location, OverBudget, RequestError

NAME = "transformers"
COLUMN = "reference:transformers"
MAX_LOGPROBS = 5
MAX_BODY = 1 << 20
MAX_PROMPTS = 64
"""Prompts per request (the accuracy row sends one per choice of an item)."""
MAX_STEPS = 1024
"""Tokens one prompt may ask for (the numerics rows ask for a few dozen)."""
HONOURED = {"model", "prompt", "max_tokens", "echo", "logprobs", "temperature", "seed", "n",
            "stream"}  # fmt: skip


class Refused(Exception):
    """A request the reference will not answer, as the platform's own error ``kind`` says
    it (status, code and OpenAI type are the error class's)."""

    def __init__(self, kind: type[RequestError], message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.kind, self.param = kind, param


class TransformersReference:
    """The model of ``model_dir`` served by transformers on ``127.0.0.1`` while in a ``with``
    block; :attr:`url` is its endpoint."""

    def __init__(self, model_dir: Path) -> None:
        if not (model_dir / "config.json").is_file():
            raise ConfigError(f"{model_dir} is not a Hugging Face model directory (no config.json)",
                              location=Location("--reference transformers"))  # fmt: skip
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer
        from transformers.utils import logging as hf_logging

        from kunlun.engine.tokenizer import Tokenizer
        from kunlun.protocol.responses import TokenText

        self.torch = torch
        hf_logging.disable_progress_bar()  # adapt says what it loads
        try:
            self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
            self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        except (OSError, ValueError, KeyError, RuntimeError) as exc:
            raise ConfigError(f"transformers cannot load {model_dir}: {exc}",
                              location=Location("--reference transformers"),
                              hint="give a Hugging Face directory of unquantized weights") from None  # fmt: skip
        self.model.eval()
        self.texts = TokenText(Tokenizer(model_dir))
        self.lock = threading.Lock()
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def __enter__(self) -> TransformersReference:
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()

    def complete(self, body: dict[str, Any]) -> dict[str, Any]:
        """The ``/v1/completions`` answer of ``body`` (:class:`Refused` when it asks for what
        is not served)."""
        for key in body:
            if key not in HONOURED:
                raise Refused(EngineLacks, f"the transformers reference does not honour {key!r}",
                              key)  # fmt: skip
        if body.get("stream") or int(body.get("n") or 1) != 1 or body.get("temperature", 1) != 0:
            field = (
                "stream" if body.get("stream") else "n" if body.get("n", 1) != 1 else "temperature"
            )
            raise Refused(EngineLacks, f"the transformers reference answers greedily, one "
                          f"choice, unstreamed: {field} refused", field)  # fmt: skip
        prompts = body.get("prompt")
        prompts = [prompts] if isinstance(prompts, str) else prompts
        if (
            not isinstance(prompts, list)
            or not prompts
            or not all(isinstance(p, str) for p in prompts)
        ):
            raise Refused(RequestError, "prompt must be a string or a list of strings", "prompt")
        if len(prompts) > MAX_PROMPTS:
            raise Refused(OverBudget, f"{len(prompts)} prompts, at most {MAX_PROMPTS}", "prompt")
        wanted = body.get("logprobs")
        k = -1 if wanted is None else int(wanted)  # -1: no logprobs
        if not -1 <= k <= MAX_LOGPROBS:
            raise Refused(RequestError, f"logprobs at most {MAX_LOGPROBS}", "logprobs")
        steps = int(body.get("max_tokens") or 0) if "max_tokens" in body else 16
        if not 0 <= steps <= MAX_STEPS:
            raise Refused(OverBudget, f"max_tokens {steps}: 0 to {MAX_STEPS}", "max_tokens")
        choices, used = [], [0, 0]
        for index, prompt in enumerate(prompts):
            choice, counts = self._one(prompt, steps, bool(body.get("echo")), k)
            choices.append({"index": index, **choice})
            used = [used[0] + counts[0], used[1] + counts[1]]
        return {"object": "text_completion", "model": body.get("model") or NAME,
                "choices": choices, "usage": {"prompt_tokens": used[0], "completion_tokens": used[1],
                                              "total_tokens": sum(used)}}  # fmt: skip

    def _one(self, prompt: str, steps: int, echo: bool, k: int) -> tuple[dict[str, Any], list[int]]:
        """One prompt's greedy choice; ``k`` top logprobs per token (-1: none)."""
        from kunlun.protocol.responses import completion_logprobs

        torch = self.torch
        ids = list(self.tokenizer(prompt)["input_ids"])
        with self.lock, torch.inference_mode():
            logits = self.model(torch.tensor([ids])).logits[0].float()
            entries: list[dict[int, float] | None] = [None]
            for pos in range(1, len(ids) if echo else 0):
                entries.append(_entry(logits[pos - 1].log_softmax(-1), ids[pos], k))
            out: list[int] = []
            dist = logits[-1].log_softmax(-1)
            for _ in range(steps):
                token = int(dist.argmax())
                out.append(token)
                entries.append(_entry(dist, token, k))
                if token == self.tokenizer.eos_token_id or len(out) == steps:
                    break
                dist = self.model(torch.tensor([ids + out])).logits[0, -1].float().log_softmax(-1)
        text = str(self.tokenizer.decode(out, skip_special_tokens=True))
        shown, said = (ids + out, entries) if echo else (out, entries[1:])
        choice: dict[str, Any] = {
            "text": (prompt + text) if echo else text,
            "finish_reason": "stop" if out and out[-1] == self.tokenizer.eos_token_id else "length",
            "logprobs": None if k < 0 else completion_logprobs(self.texts, shown, said, k),
        }  # fmt: skip
        return choice, [len(ids), len(out)]


def _entry(dist: Any, token: int, k: int) -> dict[int, float]:
    """The logprobs of ``token`` and of the ``k`` most likely tokens at one position."""
    top = dist.topk(max(k, 1))
    found = {int(i): float(v) for v, i in zip(top.values, top.indices, strict=True)}
    found[token] = float(dist[token])
    return found


def _handler(ref: TransformersReference) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, format: str, *args: Any) -> None:  # quiet: the battery reports
            return

        def _send(self, status: int, doc: dict[str, Any]) -> None:
            data = json.dumps(doc).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _refuse(self, exc: Refused) -> None:
            kind = exc.kind
            self._send(kind.http_status, {"error": {"message": str(exc), "type": kind.openai_type,
                                                    "code": kind.code, "param": exc.param}})  # fmt: skip

        def do_GET(self) -> None:
            if self.path == "/v1/models":
                self._send(200, {"object": "list", "data": [
                    {"id": NAME, "object": "model", "owned_by": "transformers"}]})  # fmt: skip
            else:
                self._refuse(Refused(EngineLacks, f"the transformers reference serves no "
                                     f"{self.path}", self.path))  # fmt: skip

        def do_POST(self) -> None:
            try:
                if self.path != "/v1/completions":
                    raise Refused(EngineLacks, f"the transformers reference serves no "
                                  f"{self.path}", self.path)  # fmt: skip
                size = int(self.headers.get("Content-Length") or 0)
                if size > MAX_BODY:
                    raise Refused(OverBudget, f"body over {MAX_BODY} bytes")
                try:
                    body = json.loads(self.rfile.read(size))
                except ValueError as exc:
                    raise Refused(RequestError, f"not JSON: {exc}") from None
                if not isinstance(body, dict):
                    raise Refused(RequestError, "the body must be a JSON object")
                self._send(200, ref.complete(body))
            except Refused as exc:
                self._refuse(exc)

    return Handler
