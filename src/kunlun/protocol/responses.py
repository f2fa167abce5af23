"""OpenAI response bodies built from engine outputs: completions, chunks, usage, logprobs.

Each builder returns a plain ``dict`` ready for JSON. Logprobs come in each API's own shape:
chat puts ``{token, logprob, bytes, top_logprobs}`` per token under ``content``; completions
use four parallel lists (``tokens``, ``token_logprobs``, ``top_logprobs``, ``text_offset``),
and with ``echo`` the first prompt token's logprob is ``None``.
"""

from __future__ import annotations

import functools
import math
import time
from collections.abc import Iterable
from typing import Any

from kunlun.engine.outputs import RequestOutput
from kunlun.engine.sequence import TopLogprobs
from kunlun.engine.tokenizer import Tokenizer

_LOGPROB_FLOOR = -9999.0
"""Stands in for -inf, which JSON cannot carry."""


@functools.cache
def _byte_decoder() -> dict[str, int]:
    """The inverse of GPT-2's byte-to-unicode table used by byte-level BPE vocabularies."""
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    chars = list(printable)
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars, strict=True)}


class TokenText:
    """The text and exact bytes of single tokens, cached (only used for logprobs)."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer
        self._cache: dict[int, tuple[str, list[int]]] = {}

    def __call__(self, token_id: int) -> tuple[str, list[int]]:
        found = self._cache.get(token_id)
        if found is None:
            found = self._cache[token_id] = self._lookup(token_id)
        return found

    def _lookup(self, token_id: int) -> tuple[str, list[int]]:
        raw = self._tokenizer.id_to_token(token_id) or ""
        decoder = _byte_decoder()
        if (
            raw
            and token_id not in self._tokenizer.all_special_ids
            and all(c in decoder for c in raw)
        ):
            data = bytes(decoder[c] for c in raw)  # byte-level BPE: exact bytes
        else:
            data = self._tokenizer.decode([token_id], skip_special_tokens=False).encode()
        return data.decode("utf-8", errors="replace"), list(data)


class TokenIdNames(TokenText):
    """Tokens named by id (``token_id:N``, vLLM's ``return_tokens_as_token_ids``), with their
    exact bytes: a client that must know which token it got, where two tokens print alike."""

    def _lookup(self, token_id: int) -> tuple[str, list[int]]:
        return f"token_id:{token_id}", super()._lookup(token_id)[1]


def prompt_logprobs(
    tokens: TokenText, token_ids: list[int], entries: list[TopLogprobs | None], k: int
) -> list[dict[str, Any] | None]:
    """vLLM's ``prompt_logprobs``: per prompt token, ``None`` for the first, else
    ``{token id: {logprob, rank, decoded_token}}`` for the token and the ``k`` most likely
    ones. ``rank`` is a token's place among those (1 = most likely); ``None`` for a prompt
    token outside them (its logprob is still given)."""
    result: list[dict[str, Any] | None] = []
    for token_id, entry in zip(token_ids, entries, strict=True):
        if entry is None:
            result.append(None)
            continue
        outside = len(entry) > k  # the prompt's token is not among the top k
        ranked = _top(entry, len(entry))
        result.append({
            str(t): {"logprob": _finite(lp),
                     "rank": None if outside and t == token_id else place,
                     "decoded_token": tokens(t)[0]}
            for place, (t, lp) in enumerate(ranked, start=1)
        })  # fmt: skip
    return result


def _finite(logprob: float) -> float:
    return logprob if math.isfinite(logprob) else _LOGPROB_FLOOR


def _top(entry: TopLogprobs, k: int) -> list[tuple[int, float]]:
    return sorted(entry.items(), key=lambda item: item[1], reverse=True)[:k]


def chat_logprobs(
    tokens: TokenText, token_ids: Iterable[int], entries: Iterable[TopLogprobs], k: int
) -> dict[str, Any]:
    """``choices[].logprobs`` of the chat API for these output tokens."""
    content = []
    for token_id, entry in zip(token_ids, entries, strict=True):
        text, data = tokens(token_id)
        top = []
        for top_id, logprob in _top(entry, k):
            top_text, top_data = tokens(top_id)
            top.append({"token": top_text, "logprob": _finite(logprob), "bytes": top_data})
        content.append(
            {"token": text, "logprob": _finite(entry[token_id]), "bytes": data, "top_logprobs": top}
        )
    return {"content": content}


def completion_logprobs(
    tokens: TokenText,
    token_ids: Iterable[int],
    entries: Iterable[TopLogprobs | None],
    k: int,
    text_offset: int = 0,
) -> dict[str, Any]:
    """``choices[].logprobs`` of the completions API; a ``None`` entry (the first prompt
    token under ``echo``) has ``None`` logprobs."""
    result: dict[str, list[Any]] = {
        "tokens": [],
        "token_logprobs": [],
        "top_logprobs": [],
        "text_offset": [],
    }
    for token_id, entry in zip(token_ids, entries, strict=True):
        text, _ = tokens(token_id)
        result["tokens"].append(text)
        result["text_offset"].append(text_offset)
        text_offset += len(text)
        if entry is None:
            result["token_logprobs"].append(None)
            result["top_logprobs"].append(None)
            continue
        result["token_logprobs"].append(_finite(entry[token_id]))
        result["top_logprobs"].append({tokens(t)[0]: _finite(lp) for t, lp in _top(entry, k)})
    return result


def usage(num_prompt: int, num_completion: int, num_cached: int) -> dict[str, Any]:
    return {
        "prompt_tokens": num_prompt,
        "completion_tokens": num_completion,
        "total_tokens": num_prompt + num_completion,
        "prompt_tokens_details": {"cached_tokens": num_cached},
    }


def request_usage(outputs: list[RequestOutput]) -> dict[str, Any]:
    """Usage summed over the requests of one API call (one per prompt)."""
    return usage(
        sum(len(o.prompt_token_ids) for o in outputs),
        sum(len(c.token_ids) for o in outputs for c in o.outputs),
        sum(o.num_cached_tokens for o in outputs),
    )


def chat_completion(
    response_id: str, model: str, output: RequestOutput, tokens: TokenText, top_k: int | None
) -> dict[str, Any]:
    """A whole ``chat.completion`` object."""
    choices = []
    for c in output.outputs:
        logprobs = None
        if top_k is not None and c.logprobs is not None:
            logprobs = chat_logprobs(tokens, c.token_ids, c.logprobs, top_k)
        choices.append(
            {
                "index": c.index,
                "message": {"role": "assistant", "content": c.text},
                "logprobs": logprobs,
                "finish_reason": c.finish_reason,
            }
        )
    return {
        "id": response_id,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": choices,
        "usage": request_usage([output]),
    }


def text_completion(
    response_id: str,
    model: str,
    outputs: list[RequestOutput],
    tokens: TokenText,
    top_k: int | None,
    echo_prompts: list[str] | None,
) -> dict[str, Any]:
    """A whole ``text_completion`` object; ``echo_prompts`` are the prompts' texts when
    ``echo`` is set. Choice ``i * n + j`` is completion ``j`` of prompt ``i``."""
    choices = []
    for i, output in enumerate(outputs):
        n = len(output.outputs)
        prefix = echo_prompts[i] if echo_prompts is not None else ""
        for c in output.outputs:
            logprobs = None
            if top_k is not None and c.logprobs is not None:
                ids: list[int] = list(c.token_ids)
                entries: list[TopLogprobs | None] = list(c.logprobs)
                if echo_prompts is not None and output.prompt_logprobs is not None:
                    ids = [*output.prompt_token_ids, *ids]
                    entries = [*output.prompt_logprobs, *entries]
                logprobs = completion_logprobs(tokens, ids, entries, top_k)
            choices.append(
                {
                    "index": i * n + c.index,
                    "text": prefix + c.text,
                    "logprobs": logprobs,
                    "finish_reason": c.finish_reason,
                }
            )
    return {
        "id": response_id,
        "object": "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": choices,
        "usage": request_usage(outputs),
    }


def chunk(
    response_id: str,
    obj: str,
    created: int,
    model: str,
    choices: list[dict[str, Any]],
    usage_value: dict[str, Any] | None = None,
    with_usage: bool = False,
) -> dict[str, Any]:
    """One streamed chunk (``chat.completion.chunk`` or ``text_completion``); with
    ``with_usage`` it carries a ``usage`` field (null except on the last chunk, unless the
    request asked for the usage so far in every chunk)."""
    body: dict[str, Any] = {
        "id": response_id,
        "object": obj,
        "created": created,
        "model": model,
        "choices": choices,
    }
    if with_usage:
        body["usage"] = usage_value
    return body
