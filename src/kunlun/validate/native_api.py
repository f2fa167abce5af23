"""Native (non-OpenAI) inference APIs: SGLang's ``/generate``, cross-checked against the
OpenAI completions route of the same server.

A target that has no ``/generate`` (it answers 404 or 405, not about the model) gets SKIP: the row is about
servers that offer SGLang's native API, Kunlun among them.
"""

from __future__ import annotations

from typing import Any

from kunlun.validate.check import Check, Context, check
from kunlun.validate.client import error_message, json_of
from kunlun.validate.matrix import Cell, failed, passed, skipped

CHECKS: list[Check] = []

GENERATE_PROMPT = "The three primary colours are"
GENERATE_TOKENS = 8


@check(CHECKS, "api.generate", "SGLang /generate")
def generate(ctx: Context) -> Cell:
    """Greedy ``/generate`` of a short prompt: SGLang's answer shape, with a finish reason
    and token counts that agree with ``/v1/completions`` on the same prompt, and the same
    text."""
    body = {"model": ctx.column.model, "text": GENERATE_PROMPT,
            "sampling_params": {"temperature": 0, "max_new_tokens": GENERATE_TOKENS}}  # fmt: skip
    resp = ctx.client.request("POST", "/generate", body)
    data = json_of(resp)
    error = data.get("error")
    error = error if isinstance(error, dict) else {}
    if resp.status_code in (404, 405) and error.get("code") != "model_not_found":
        return skipped("the endpoint has no /generate (SGLang's native API)")
    if resp.status_code != 200:
        return failed(f"HTTP {resp.status_code}", error_message(data, resp))
    meta = data.get("meta_info")
    if not isinstance(data.get("text"), str) or not isinstance(meta, dict):
        return failed("not SGLang's shape", f"expected {{text, meta_info}}, got {resp.text[:200]}")
    ctx.client.record("generate", data["text"])
    want = ctx.client.completion("generate", GENERATE_PROMPT, max_tokens=GENERATE_TOKENS,
                                 temperature=0)  # fmt: skip
    problem = _disagreement(meta, data["text"], want.text, want.usage,
                            want.choice.get("finish_reason"))  # fmt: skip
    if problem:
        return failed("differs from /v1/completions", problem)
    reason = meta["finish_reason"]["type"]
    return passed(f"{meta['completion_tokens']} tokens, {reason}", data["text"])


def _disagreement(
    meta: dict[str, Any], text: str, want_text: str, usage: dict[str, Any], want_finish: Any
) -> str | None:
    """What in ``/generate``'s answer disagrees with the completions route's, or None."""
    finish = meta.get("finish_reason")
    if not isinstance(finish, dict) or finish.get("type") not in ("stop", "length"):
        return f"finish_reason {finish!r} is not {{type: stop|length, ...}}"
    if finish["type"] != want_finish:
        return f"finish_reason type {finish['type']!r}, the completions route says {want_finish!r}"
    if finish["type"] == "length" and finish.get("length") != GENERATE_TOKENS:
        return f"a length finish of max_new_tokens={GENERATE_TOKENS} says {finish!r}"
    for field in ("prompt_tokens", "completion_tokens"):
        if meta.get(field) != usage.get(field):
            return f"{field} {meta.get(field)!r}, the completions route counts {usage.get(field)!r}"
    if text != want_text:
        return f"greedy text {text!r}, the completions route gave {want_text!r}"
    return None
