"""Talking to one target: OpenAI calls that record what every check needs to judge.

:class:`TargetClient` sends requests to one column's endpoint and model (with
``X-Kunlun-Pool`` for a pool column) and keeps, for the summary rows, every answer text
(the garbage detector reads them) and every ``X-Kunlun-Device`` it was answered from.
A call that should succeed and does not raises :class:`CheckFailed` with the status and the
server's message, which the battery turns into a FAIL cell.

Streams are read raw, so their framing can be judged: :func:`parse_sse` splits the bytes
into events the way the SSE specification does and lists every deviation from the OpenAI
framing (``data: <json>`` events separated by a blank line, ending with ``data: [DONE]``).
"""

from __future__ import annotations

import json
import threading
import time
from collections import Counter
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

import httpx

from kunlun.errors import EngineLacks
from kunlun.serving.routing import POOL_HEADER
from kunlun.validate.garbage import garbage_reasons
from kunlun.validate.matrix import Column
from kunlun.validate.target import DEVICE_HEADER, REPLICA_HEADER

LACKED: ContextVar[list[str] | None] = ContextVar("kunlun_validate_lacked", default=None)
"""The request fields (or routes) the engine serving the model refused as ones it lacks
(errors coded :attr:`EngineLacks.code`) during the current check; set by
:func:`~kunlun.validate.battery.run_check`."""


def _note_lacked(resp: httpx.Response) -> None:
    noted = LACKED.get()
    if noted is None:
        return
    try:
        error = resp.json()["error"]
    except (ValueError, KeyError, TypeError):
        return
    if isinstance(error, dict) and error.get("code") == EngineLacks.code:
        noted.append(str(error.get("param")))


class CheckFailed(Exception):
    """A check cannot go on: the figure for its cell, and the detail."""

    def __init__(self, figure: str, detail: str = "") -> None:
        super().__init__(f"{figure}: {detail}" if detail else figure)
        self.figure, self.detail = figure, detail


@dataclass
class Answer:
    """A successful non-streamed completion."""

    body: dict[str, Any]
    latency_s: float

    @property
    def choice(self) -> dict[str, Any]:
        choices = self.body.get("choices") or []
        if not choices or not isinstance(choices[0], dict):
            raise CheckFailed("no choices", f"the answer has no choices: {_short(self.body)}")
        return dict(choices[0])

    @property
    def text(self) -> str:
        """The first choice's text (chat ``message.content`` or completion ``text``)."""
        return choice_text(self.choice)

    def spelling(self) -> str | None:
        """The text the chat logprobs' token bytes spell, or None without logprobs. An answer
        that ended on its end-of-sequence token lists that token last, without text: it is
        left out then. Only a server that generated the text token by token knows this."""
        entries = (self.choice.get("logprobs") or {}).get("content")
        if not isinstance(entries, list):
            return None
        pieces = [bytes(e["bytes"]) if isinstance(e.get("bytes"), list)
                  else str(e.get("token")).encode() for e in entries]  # fmt: skip
        spelled = b"".join(pieces).decode("utf-8", errors="replace")
        if spelled != self.text and self.choice.get("finish_reason") == "stop" and pieces:
            return b"".join(pieces[:-1]).decode("utf-8", errors="replace")
        return spelled

    @property
    def usage(self) -> dict[str, Any]:
        usage = self.body.get("usage")
        if not isinstance(usage, dict):
            raise CheckFailed("no usage", f"the answer has no usage object: {_short(self.body)}")
        return usage


@dataclass
class Stream:
    """A streamed completion (answered 200), read raw."""

    content_type: str
    events: list[str]
    """Each event's data, in order (``[DONE]`` included)."""
    problems: list[str]
    """Framing deviations found by :func:`parse_sse`."""
    first_content_s: float | None
    """Seconds from sending to the first event that carried text."""
    elapsed_s: float
    chunks: list[dict[str, Any]] = field(default_factory=list)
    """The JSON events (everything but ``[DONE]``)."""

    def text(self, index: int = 0) -> str:
        """The streamed text of choice ``index``, concatenated."""
        parts = []
        for chunk in self.chunks:
            for choice in chunk.get("choices") or []:
                if isinstance(choice, dict) and choice.get("index", 0) == index:
                    parts.append(choice_text(choice))
        return "".join(parts)


def choice_text(choice: dict[str, Any]) -> str:
    """The text of a chat or completion choice, or of a streamed delta."""
    for key in ("message", "delta"):
        part = choice.get(key)
        if isinstance(part, dict):
            return str(part.get("content") or "")
    return str(choice.get("text") or "")


def parse_sse(raw: bytes) -> tuple[list[str], list[str]]:
    """The data of each event in ``raw`` and the framing problems found.

    Lines end with LF or CRLF; an event ends at a blank line; comment lines (``:``) are
    allowed. OpenAI framing asks that each event be exactly one ``data:`` line, that the
    stream end with a blank line, and that ``[DONE]`` be the last event.
    """
    problems: list[str] = []
    text = raw.decode("utf-8", errors="replace").replace("\r\n", "\n")
    blocks = text.split("\n\n")
    if blocks and blocks[-1].strip():
        problems.append(f"the stream does not end with a blank line: {blocks[-1][-60:]!r}")
    events: list[str] = []
    for block in blocks:
        lines = [line for line in block.split("\n") if line and not line.startswith(":")]
        if not lines:
            continue
        data = [line for line in lines if line.startswith("data:")]
        if len(data) != len(lines):
            other = next(line for line in lines if not line.startswith("data:"))
            problems.append(f"a line that is not 'data:': {other[:60]!r}")
        if len(data) > 1:
            problems.append(f"{len(data)} data lines in one event (missing blank line?)")
        events.append("\n".join(line[5:].removeprefix(" ") for line in data))
    # the stream's ending first: a report shows only the first few, and the framing problems
    # of a broken stream can be many (one per event)
    if "[DONE]" not in events:
        problems.insert(0, "no 'data: [DONE]' event")
    elif events[-1] != "[DONE]":
        problems.insert(0, f"{len(events) - 1 - events.index('[DONE]')} event(s) after [DONE]")
    return events, problems


class TargetClient:
    """OpenAI calls to one column's target (thread-safe: the battery calls it from threads)."""

    def __init__(self, column: Column, api_key: str | None, timeout_s: float = 180.0) -> None:
        self.column = column
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        if column.pool:
            headers[POOL_HEADER] = column.pool
        self.http = httpx.Client(
            base_url=column.endpoint,
            headers=headers,
            timeout=httpx.Timeout(timeout_s, connect=10.0),
            limits=httpx.Limits(max_connections=64, max_keepalive_connections=32),
        )
        self._lock = threading.Lock()
        self.answers: list[tuple[str, str]] = []
        """``(check, text)`` of every answer received."""
        self.devices: Counter[str] = Counter()
        """``X-Kunlun-Device`` of each completion answered (``""``: the header was absent)."""
        self.replicas: Counter[str] = Counter()
        """``X-Kunlun-Replica`` of each, likewise (which engine's replica, in a pool of two)."""

    def close(self) -> None:
        self.http.close()

    # ---- plain requests ----
    def request(
        self, method: str, path: str, body: Any = None, headers: dict[str, str] | None = None
    ) -> httpx.Response:
        """One request, recorded; transport failures become :class:`CheckFailed`."""
        try:
            resp = self.http.request(method, path, json=body, headers=headers)
        except httpx.HTTPError as exc:
            raise CheckFailed(
                "no answer", f"{method} {path}: {type(exc).__name__}: {exc}"
            ) from None
        self.saw(path, resp)
        return resp

    def chat(self, check: str, messages: list[dict[str, Any]], **params: Any) -> Answer:
        """A non-streamed chat completion that must succeed."""
        return self._complete(check, "/v1/chat/completions", {"messages": messages, **params})

    def completion(self, check: str, prompt: str, **params: Any) -> Answer:
        """A non-streamed text completion that must succeed."""
        return self._complete(check, "/v1/completions", {"prompt": prompt, **params})

    def continuation(self, check: str, prompt: str, **params: Any) -> Answer:
        """:meth:`completion` of a text cut mid-way: its answer, which may well be empty, is
        a fragment the garbage detector does not judge."""
        return self._complete(check, "/v1/completions", {"prompt": prompt, **params}, False)

    def _complete(self, check: str, path: str, body: dict[str, Any], judge: bool = True) -> Answer:
        started = time.perf_counter()
        resp = self.request("POST", path, {"model": self.column.model, **body})
        latency = time.perf_counter() - started
        data = json_of(resp)
        if resp.status_code != 200:
            raise CheckFailed(f"HTTP {resp.status_code}", error_message(data, resp))
        answer = Answer(data, latency)
        for choice in data.get("choices") or [] if judge else []:
            # an answer of tool calls has no text to judge (its arguments are checked)
            if isinstance(choice, dict) and choice.get("finish_reason") != "tool_calls":
                self.record(check, choice_text(choice))
        return answer

    # ---- streams ----
    def stream(self, check: str, path: str, body: dict[str, Any]) -> Stream:
        """A streamed completion, read raw (it must answer 200)."""
        payload = {"model": self.column.model, "stream": True, **body}
        started = time.perf_counter()
        raw, pending = bytearray(), b""
        first: float | None = None
        try:
            with self.http.stream("POST", path, json=payload) as resp:
                self.saw(path, resp)
                if resp.status_code != 200:
                    resp.read()
                    raise CheckFailed(
                        f"HTTP {resp.status_code}", error_message(json_of(resp), resp)
                    )
                for piece in resp.iter_bytes():
                    raw += piece
                    if first is None:
                        *complete, pending = (
                            (pending + piece).replace(b"\r\n", b"\n").split(b"\n\n")
                        )
                        if any(_has_text(block) for block in complete):
                            first = time.perf_counter() - started
                content_type = resp.headers.get("content-type", "")
        except httpx.HTTPError as exc:
            raise CheckFailed("stream broke", f"{type(exc).__name__}: {exc}") from None
        events, problems = parse_sse(bytes(raw))
        result = Stream(content_type, events, problems, first, time.perf_counter() - started)
        for data in events:
            if data == "[DONE]":
                continue
            try:
                chunk = json.loads(data)
            except ValueError:
                problems.append(f"an event that is not JSON: {data[:60]!r}")
                continue
            if not isinstance(chunk, dict):
                problems.append(f"an event that is not a JSON object: {data[:60]!r}")
            elif "error" in chunk:
                raise CheckFailed("stream error", error_message(chunk, None))
            else:
                result.chunks.append(chunk)
        self.record(check, result.text())
        return result

    # ---- records ----
    def record(self, check: str, text: str) -> None:
        """Keep an answer for the garbage detector."""
        with self._lock:
            self.answers.append((check, text))

    def garbage(self) -> list[tuple[str, str, list[str]]]:
        """``(check, text, reasons)`` of every recorded answer that looks like garbage."""
        with self._lock:
            answers = list(self.answers)
        return [(c, t, r) for c, t in answers if (r := garbage_reasons(t))]

    def saw(self, path: str, resp: httpx.Response) -> None:
        """Count the device a completion was answered from (errors and model lists are
        answered by the gateway itself, without one); note a field the serving engine lacks
        (:func:`engine_lacked`)."""
        if resp.status_code == 400:
            _note_lacked(resp)
        if resp.status_code == 200 and path.endswith("completions"):
            with self._lock:
                self.devices[resp.headers.get(DEVICE_HEADER, "")] += 1
                self.replicas[resp.headers.get(REPLICA_HEADER, "")] += 1


def _has_text(block: bytes) -> bool:
    """Whether one raw SSE event carries a chunk with non-empty text (for TTFT)."""
    for line in block.split(b"\n"):
        if not line.startswith(b"data:"):
            continue
        try:
            chunk = json.loads(line[5:])
        except ValueError:
            continue
        if isinstance(chunk, dict) and any(
            isinstance(c, dict) and choice_text(c) for c in chunk.get("choices") or []
        ):
            return True
    return False


def json_of(resp: httpx.Response) -> dict[str, Any]:
    """The body as a JSON object, or ``{}``."""
    try:
        data = resp.json()
    except ValueError:
        return {}
    return data if isinstance(data, dict) else {}


def error_message(data: dict[str, Any], resp: httpx.Response | None) -> str:
    """The server's error message, or the start of the body."""
    error = data.get("error")
    if isinstance(error, dict) and error.get("message"):
        return str(error["message"])[:300]
    return resp.text[:300] if resp is not None else _short(data)


def _short(data: Any) -> str:
    return json.dumps(data, ensure_ascii=False)[:300]
