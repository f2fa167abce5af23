"""API conformance: the OpenAI API behaves as clients (the SDK, LangChain, curl) expect.

Each check cross-checks the server against itself, so a server cannot pass by returning
well-formed but made-up fields: usage against ``max_tokens`` and the number of logprob
entries, the stream against the non-streamed answer, a stop string against the text
generated without it, seeds against each other.
"""

from __future__ import annotations

import base64
import json
import struct
from typing import Any

from kunlun.validate.check import Check, Context, check
from kunlun.validate.client import Stream, json_of
from kunlun.validate.matrix import Cell, failed, passed, skipped

CHECKS: list[Check] = []

GREEDY = {"temperature": 0}
COUNT = [{"role": "user", "content": "Count from 1 to 50, separated by spaces."}]
STORY = [{"role": "user", "content": "Tell me a short story about a cat."}]
QUESTION = [{"role": "user", "content": "Why is the sky blue? Explain briefly."}]
LENGTH_TOKENS = 6


@check(CHECKS, "api.models", "GET /v1/models")
def models(ctx: Context) -> Cell:
    resp = ctx.client.request("GET", "/v1/models")
    body = json_of(resp)
    if resp.status_code != 200:
        return failed(f"HTTP {resp.status_code}", resp.text[:200])
    data = body.get("data")
    if body.get("object") != "list" or not isinstance(data, list):
        return failed(
            "not a list", f"expected {{object: list, data: [...]}}, got {resp.text[:200]}"
        )
    ids = [m.get("id") for m in data if isinstance(m, dict) and m.get("object") == "model"]
    if ctx.column.model not in ids:
        return failed("model missing", f"{ctx.column.model!r} not in {ids}")
    return passed(f"{len(ids)} model(s)")


def _arithmetic(usage: dict[str, Any]) -> str | None:
    prompt, completion = usage.get("prompt_tokens"), usage.get("completion_tokens")
    total = usage.get("total_tokens")
    if not all(isinstance(v, int) for v in (prompt, completion, total)):
        return f"usage fields are not integers: {usage}"
    if total != prompt + completion:  # type: ignore[operator]
        return f"total_tokens {total} != prompt {prompt} + completion {completion}"
    return None


@check(CHECKS, "api.usage", "usage arithmetic")
def usage(ctx: Context) -> Cell:
    """total = prompt + completion; a length finish counts exactly ``max_tokens``; the
    completion count equals the number of logprob entries."""
    cut = ctx.client.chat("usage", COUNT, max_tokens=LENGTH_TOKENS, **GREEDY)
    problem = _arithmetic(cut.usage)
    if problem:
        return failed("total != sum", problem)
    finish = cut.choice.get("finish_reason")
    if finish != "length" or cut.usage["completion_tokens"] != LENGTH_TOKENS:
        return failed(
            "length finish miscounted",
            f"max_tokens={LENGTH_TOKENS} gave finish_reason {finish!r} and completion_tokens "
            f"{cut.usage['completion_tokens']}",
        )
    counted = ctx.client.chat("usage", QUESTION, max_tokens=ctx.settings.max_tokens,
                              logprobs=True, **GREEDY)  # fmt: skip
    entries = ((counted.choice.get("logprobs") or {}).get("content")) or []
    problem = _arithmetic(counted.usage)
    if problem:
        return failed("total != sum", problem)
    if len(entries) != counted.usage["completion_tokens"]:
        return failed(
            "completion_tokens miscounted",
            f"completion_tokens {counted.usage['completion_tokens']} but {len(entries)} "
            f"generated tokens carry logprobs",
        )
    return passed(f"{counted.usage['prompt_tokens']}+{counted.usage['completion_tokens']} ok")


def _framing(stream: Stream, obj: str) -> list[str]:
    problems = list(stream.problems)
    if not stream.content_type.startswith("text/event-stream"):
        problems.append(f"content-type {stream.content_type!r}, not text/event-stream")
    ids = {c.get("id") for c in stream.chunks}
    if len(ids) != 1:
        problems.append(f"{len(ids)} different ids across the chunks")
    kinds = {c.get("object") for c in stream.chunks} - {obj}
    if kinds:
        problems.append(f"chunk objects {sorted(map(str, kinds))}, expected {obj!r}")
    finishes = [ch.get("finish_reason") for c in stream.chunks for ch in c.get("choices") or []
                if isinstance(ch, dict) and ch.get("finish_reason")]  # fmt: skip
    if not finishes:
        problems.append("no chunk carries a finish_reason")
    return problems


@check(CHECKS, "api.sse", "SSE framing and [DONE]")
def sse_framing(ctx: Context) -> Cell:
    """Chat and text streams: ``data: <json>`` events, one id, a finish_reason, ``[DONE]``
    last; the first chat delta carries the assistant role."""
    chat = ctx.client.stream("sse", "/v1/chat/completions",
                             {"messages": STORY, "max_tokens": ctx.settings.max_tokens, **GREEDY})  # fmt: skip
    problems = _framing(chat, "chat.completion.chunk")
    first = next((c for c in chat.chunks if c.get("choices")), {})
    role = ((first.get("choices") or [{}])[0].get("delta") or {}).get("role")
    if role != "assistant":
        problems.append(f"the first chat delta has role {role!r}, not 'assistant'")
    text = ctx.client.stream("sse", "/v1/completions",
                             {"prompt": "Once upon a time", "max_tokens": ctx.settings.max_tokens,
                              **GREEDY})  # fmt: skip
    problems += [f"completions: {p}" for p in _framing(text, "text_completion")]
    if problems:
        return failed(f"{len(problems)} problem(s)", "; ".join(problems[:4]))
    return passed(f"{len(chat.events) + len(text.events)} events ok")


@check(CHECKS, "api.include_usage", "stream include_usage chunk")
def include_usage(ctx: Context) -> Cell:
    """The last chunk before ``[DONE]`` has ``choices: []`` and the usage the non-streamed
    answer reports; earlier chunks carry ``usage: null``."""
    body = {"messages": QUESTION, "max_tokens": ctx.settings.max_tokens, **GREEDY}
    stream = ctx.client.stream("include_usage", "/v1/chat/completions",
                               {**body, "stream_options": {"include_usage": True}})  # fmt: skip
    if not stream.chunks:
        return failed("no chunks", "; ".join(stream.problems))
    last = stream.chunks[-1]
    if last.get("choices") != [] or not isinstance(last.get("usage"), dict):
        return failed("no usage chunk", f"last chunk: {str(last)[:200]}")
    early = [c.get("usage") for c in stream.chunks[:-1] if c.get("usage") is not None]
    if early:
        return failed("usage too early", f"{len(early)} earlier chunk(s) carry usage")
    streamed = last["usage"]
    problem = _arithmetic(streamed)
    if problem:
        return failed("total != sum", problem)
    whole = ctx.client.chat("include_usage", QUESTION, max_tokens=ctx.settings.max_tokens, **GREEDY)
    keys = ("prompt_tokens", "completion_tokens")
    if any(streamed.get(k) != whole.usage.get(k) for k in keys):
        return failed(
            "usage differs",
            f"streamed {[streamed.get(k) for k in keys]} vs non-streamed "
            f"{[whole.usage.get(k) for k in keys]}",
        )
    return passed(f"{streamed['prompt_tokens']}+{streamed['completion_tokens']} tokens")


@check(CHECKS, "api.stream_equals", "streamed text = non-streamed (greedy)")
def stream_equals(ctx: Context) -> Cell:
    differences = []
    for messages in (STORY, QUESTION):
        body = {"messages": messages, "max_tokens": ctx.settings.max_tokens, **GREEDY}
        streamed = ctx.client.stream("stream_equals", "/v1/chat/completions", body).text()
        whole = ctx.client.chat("stream_equals", messages, **body_without(body, "messages")).text
        if streamed != whole:
            differences.append(f"streamed {streamed!r} vs {whole!r}")
    if differences:
        return failed("text differs", "; ".join(differences))
    return passed("identical (2 prompts)")


def body_without(body: dict[str, Any], *keys: str) -> dict[str, Any]:
    return {k: v for k, v in body.items() if k not in keys}


@check(CHECKS, "api.stop", "stop sequences")
def stop(ctx: Context) -> Cell:
    """A word from the middle of a greedy answer, given as ``stop``, ends the answer right
    before it with finish_reason ``stop``."""
    params = {"max_tokens": ctx.settings.max_tokens, **GREEDY}
    text = ctx.client.chat("stop", STORY, **params).text
    words = [w.strip(".,!?;:\"'") for w in text.split()]
    candidates = [w for w in words[2:] if len(w) >= 3]
    if not candidates:
        return failed("no stop word", f"the greedy answer {text!r} has no word to stop at")
    word = candidates[0]
    expected = text[: text.index(word)]
    cut = ctx.client.chat("stop", STORY, stop=[word], **params)
    if cut.text != expected or cut.choice.get("finish_reason") != "stop":
        return failed(
            "not cut at stop",
            f"stop={word!r}: expected {expected!r} with finish_reason 'stop', got "
            f"{cut.text!r} with {cut.choice.get('finish_reason')!r}",
        )
    return passed(f"cut at {word!r}")


@check(CHECKS, "api.n", "n choices")
def n_choices(ctx: Context) -> Cell:
    """``n=3`` gives choices 0, 1, 2, not all the same, whose token counts add up to
    ``completion_tokens``."""
    answer = ctx.client.chat("n", STORY, n=3, temperature=1.0, logprobs=True,
                             max_tokens=ctx.settings.max_tokens)  # fmt: skip
    choices = answer.body.get("choices") or []
    indices = sorted(int(c.get("index", -1)) for c in choices if isinstance(c, dict))
    if indices != [0, 1, 2]:
        return failed(f"{len(choices)} choices", f"choice indices {indices}, expected [0, 1, 2]")
    texts = [(c.get("message") or {}).get("content") or "" for c in choices]
    counted = sum(len((c.get("logprobs") or {}).get("content") or []) for c in choices)
    if counted != answer.usage.get("completion_tokens"):
        return failed(
            "usage != choices",
            f"completion_tokens {answer.usage.get('completion_tokens')} but the three choices "
            f"have {counted} tokens",
        )
    if len(set(texts)) < 2:
        return failed("3 identical", f"all three choices are {texts[0]!r} at temperature 1")
    return passed(f"3 choices, {len(set(texts))} distinct")


@check(CHECKS, "api.logprobs", "logprobs")
def logprobs(ctx: Context) -> Cell:
    """Greedy with ``top_logprobs=3``: one entry per token, logprobs <= 0, alternatives
    sorted, the chosen token the most likely one, the tokens spelling the text."""
    answer = ctx.client.chat("logprobs", QUESTION, logprobs=True, top_logprobs=3,
                             max_tokens=ctx.settings.max_tokens, **GREEDY)  # fmt: skip
    entries = (answer.choice.get("logprobs") or {}).get("content") or []
    if not entries:
        return failed("no logprobs", "logprobs=true gave no logprobs.content")
    problems = []
    for i, entry in enumerate(entries):
        top = entry.get("top_logprobs") or []
        values = [t.get("logprob", 0.0) for t in top]
        if entry.get("logprob", 1.0) > 1e-6 or any(v > 1e-6 for v in values):
            problems.append(f"token {i}: a logprob above 0")
        if len(top) != 3 or values != sorted(values, reverse=True):
            problems.append(f"token {i}: top_logprobs not 3 sorted entries: {values}")
        elif top[0].get("token") != entry.get("token") or abs(values[0] - entry["logprob"]) > 1e-3:
            problems.append(f"token {i}: greedy chose {entry.get('token')!r}, not the top one")
    spelled = answer.spelling()
    if spelled != answer.text:
        problems.append(f"the tokens spell {spelled!r}, not the text {answer.text!r}")
    if problems:
        return failed(f"{len(problems)} problem(s)", "; ".join(problems[:3]))
    return passed(f"{len(entries)} tokens ok")


@check(CHECKS, "api.seed", "seed reproducibility")
def seed(ctx: Context) -> Cell:
    """Sampling at temperature 1: the same seed twice gives the same text; three seeds do
    not all give the same text."""
    params = {"max_tokens": ctx.settings.max_tokens, "temperature": 1.0}
    texts = {s: ctx.client.chat("seed", STORY, seed=s, **params).text for s in (11, 12, 13)}
    again = ctx.client.chat("seed", STORY, seed=11, **params).text
    if again != texts[11]:
        return failed("not reproducible", f"seed 11 gave {texts[11]!r} then {again!r}")
    if len(set(texts.values())) < 2:
        return failed("seed ignored", f"seeds 11, 12, 13 all gave {again!r}")
    return passed("same seed, same text")


PLACE = [{"role": "user", "content": "Describe the capital of France as JSON."}]
PLACE_SCHEMA: dict[str, Any] = {
    "type": "object", "additionalProperties": False,
    "required": ["city", "country", "population"],
    "properties": {"city": {"type": "string", "maxLength": 24},
                   "country": {"type": "string", "maxLength": 24},
                   "population": {"type": "integer", "minimum": 0, "maximum": 100_000_000}},
}  # fmt: skip
SCHEMA_TOKENS = 96


def _place_problem(value: Any) -> str | None:
    """Why ``value`` does not validate against :data:`PLACE_SCHEMA`, or None."""
    if not isinstance(value, dict):
        return f"not an object: {short(value)}"
    keys = set(value)
    if keys != {"city", "country", "population"}:
        return f"keys {sorted(keys)}, the schema wants exactly city, country, population"
    for key in ("city", "country"):
        if not isinstance(value[key], str) or len(value[key]) > 24:
            return f"{key} is not a string of at most 24 characters: {short(value[key])}"
    population = value["population"]
    if not isinstance(population, int) or isinstance(population, bool):
        return f"population is not an integer: {short(population)}"
    if not 0 <= population <= 100_000_000:
        return f"population {population} is outside [0, 100000000]"
    return None


@check(CHECKS, "api.json_schema", "structured output (json_schema)")
def json_schema(ctx: Context) -> Cell:
    """``response_format`` with a JSON schema (greedy): the answer finishes with ``stop`` and
    is JSON that validates against the schema."""
    fmt = {"type": "json_schema",
           "json_schema": {"name": "place", "schema": PLACE_SCHEMA, "strict": True}}  # fmt: skip
    answer = ctx.client.chat("json_schema", PLACE, max_tokens=SCHEMA_TOKENS,
                             response_format=fmt, **GREEDY)  # fmt: skip
    reason = answer.choice.get("finish_reason")
    if reason != "stop":
        return failed(f"finish {reason}", f"no complete answer in {SCHEMA_TOKENS} tokens: "
                      f"{short(answer.text)}")  # fmt: skip
    try:
        value = json.loads(answer.text)
    except ValueError as exc:
        return failed("not JSON", f"{exc}: {short(answer.text)}")
    problem = _place_problem(value)
    if problem:
        return failed("schema violated", problem)
    return passed(f"valid {value['city']!r}", f"{answer.text}")


EMBED_INPUTS = ["The quick brown fox jumps over the lazy dog.", "Paris is in France."]


@check(CHECKS, "api.embeddings", "POST /v1/embeddings")
def embeddings(ctx: Context) -> Cell:
    """A model served for embeddings (its ``/v1/models`` card says ``task: embed``): vectors
    of the stated dimension and unit norm, the same input twice the same vector, base64 the
    float form's bytes. Any other model: ``/v1/embeddings`` is refused with a 400 naming
    ``model`` that says what it is served for."""
    model = ctx.column.model
    cards = json_of(ctx.client.request("GET", "/v1/models")).get("data") or []
    card = next((c for c in cards if isinstance(c, dict) and c.get("id") == model), {})
    body = {"model": model, "input": [*EMBED_INPUTS, EMBED_INPUTS[0]], "encoding_format": "float"}
    resp = ctx.client.request("POST", "/v1/embeddings", body)
    if card.get("task") != "embed":
        problem = _error_shape(resp, 400)
        if problem:
            return failed("not refused", f"a model served for generation: {problem}")
        error = json_of(resp)["error"]
        if error.get("param") != "model" or "generation" not in error["message"]:
            return failed("refusal unclear", f"param {error.get('param')!r}: {error['message']}")
        return passed("400 (generation model)", error["message"])
    problem = _vectors_problem(resp)
    if problem:
        return failed("bad vectors", problem)
    floats = json_of(resp)["data"]
    coded = ctx.client.request("POST", "/v1/embeddings", {**body, "encoding_format": "base64"})
    problem = _base64_problem(coded, [d["embedding"] for d in floats])
    if problem:
        return failed("base64 differs", problem)
    return passed(f"dim {len(floats[0]['embedding'])}")


def _vectors_problem(resp: Any) -> str | None:
    """Why a float answer to :data:`EMBED_INPUTS` plus the first again is wrong, or None."""
    if resp.status_code != 200:
        return f"HTTP {resp.status_code}: {resp.text[:160]}"
    data = json_of(resp).get("data")
    if not isinstance(data, list) or len(data) != 3:
        return f"expected 3 embeddings, got {short(data)}"
    vectors = [d.get("embedding") if isinstance(d, dict) else None for d in data]
    if [d.get("index") for d in data] != [0, 1, 2] or not all(
        isinstance(v, list) and v and all(isinstance(x, float | int) for x in v) for v in vectors
    ):
        return f"indices or vectors malformed: {short(data)}"
    sizes = {len(v) for v in vectors}  # type: ignore[arg-type]
    if len(sizes) != 1:
        return f"vectors of different sizes {sorted(sizes)}"
    norms = [sum(x * x for x in v) ** 0.5 for v in vectors]  # type: ignore[union-attr]
    if any(abs(n - 1) > 1e-3 for n in norms):
        return f"not unit norm: {[round(n, 5) for n in norms]}"
    first, again = vectors[0], vectors[2]
    if max(abs(a - b) for a, b in zip(first, again, strict=True)) > 1e-5:  # type: ignore[arg-type]
        return "the same input twice gave different vectors"
    return None


def _base64_problem(resp: Any, floats: list[list[float]]) -> str | None:
    """Why the base64 answer is not the float answer's little-endian float32 bytes, or None."""
    if resp.status_code != 200:
        return f"HTTP {resp.status_code}: {resp.text[:160]}"
    try:
        coded = [base64.b64decode(d["embedding"]) for d in json_of(resp)["data"]]
        decoded = [list(struct.unpack(f"<{len(b) // 4}f", b)) for b in coded]
    except (KeyError, TypeError, ValueError, struct.error) as exc:
        return f"not base64 float32: {exc}"
    if [len(v) for v in decoded] != [len(v) for v in floats]:
        return "sizes differ from the float answer"
    worst = max(
        abs(a - b) for u, v in zip(decoded, floats, strict=True) for a, b in zip(u, v, strict=True)
    )
    return None if worst <= 1e-6 else f"largest difference {worst:.3g}"


def short(value: Any) -> str:
    """``value`` for a message: a string as it is, anything else as its repr; cut at 120."""
    text = value if isinstance(value, str) else repr(value)
    return text if len(text) <= 120 else text[:117] + "..."


def _error_shape(resp: Any, status: int) -> str | None:
    """Why ``resp`` is not an OpenAI error with ``status``, or None."""
    if resp.status_code != status:
        return f"HTTP {resp.status_code}, expected {status}: {resp.text[:120]}"
    error = json_of(resp).get("error")
    if not isinstance(error, dict):
        return f"body has no 'error' object: {resp.text[:120]}"
    if not isinstance(error.get("message"), str) or not error["message"]:
        return "error.message missing"
    if not isinstance(error.get("type"), str):
        return "error.type missing"
    if "param" not in error or "code" not in error:
        return "error.param or error.code missing"
    return None


@check(CHECKS, "api.error_400", "error 400 (bad parameter)")
def error_400(ctx: Context) -> Cell:
    model = ctx.client.column.model
    cases = {
        "temperature=5": {"model": model, "messages": QUESTION, "temperature": 5},
        "no messages": {"model": model},
    }
    for name, body in cases.items():
        problem = _error_shape(ctx.client.request("POST", "/v1/chat/completions", body), 400)
        if problem:
            return failed("not 400", f"{name}: {problem}")
    return passed("400, OpenAI shape")


@check(CHECKS, "api.error_401", "error 401 (wrong key)")
def error_401(ctx: Context) -> Cell:
    if not ctx.settings.api_key:
        resp = ctx.client.request("GET", "/v1/models", headers={"Authorization": "Bearer wrong"})
        if resp.status_code == 200:
            return skipped("the endpoint has no API keys (a wrong key is accepted)")
    resp = ctx.client.request(
        "POST",
        "/v1/chat/completions",
        {"model": ctx.client.column.model, "messages": QUESTION, "max_tokens": 1},
        headers={"Authorization": "Bearer kunlun-validate-wrong-key"},
    )
    problem = _error_shape(resp, 401)
    return failed("not 401", problem) if problem else passed("401, OpenAI shape")


@check(CHECKS, "api.error_404", "error 404 (unknown model)")
def error_404(ctx: Context) -> Cell:
    body = {"model": "kunlun-validate-no-such-model", "messages": QUESTION, "max_tokens": 1}
    problem = _error_shape(ctx.client.request("POST", "/v1/chat/completions", body), 404)
    return failed("not 404", problem) if problem else passed("404, OpenAI shape")
