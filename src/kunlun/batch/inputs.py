"""The input of ``kunlun-cli batch run``: one JSON object per line.

``{"id": ..., "prompt": ...}`` is a text completion (``/v1/completions``);
``{"id": ..., "messages": [...]}`` a chat completion (``/v1/chat/completions``). Every other
field (``max_tokens``, ``temperature``, ``stop``...) is passed to the endpoint as is. A line
that cannot run (not JSON, no id, an id seen before, neither or both of prompt and messages)
becomes a :class:`BadLine` with its line number; the other lines still run. Blank lines are
skipped.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kunlun import json_text
from kunlun.errors import ConfigError, Location, RequestError

COMPLETIONS = "/v1/completions"
CHAT_COMPLETIONS = "/v1/chat/completions"


@dataclass(frozen=True)
class BatchRequest:
    """One runnable input line."""

    id: str | int
    """The id as written in the input (kept as is in the outputs)."""
    line: int
    path: str
    """``/v1/completions`` or ``/v1/chat/completions``."""
    params: dict[str, Any]
    """The request body without ``model`` (the task adds it)."""

    @property
    def key(self) -> str:
        """The id as text: what results are matched on and request ids carry."""
        return str(self.id)


class InvalidInputLine(RequestError):
    """A line of a batch input file that cannot be sent: recorded in ``failures.jsonl``
    under this code (the job goes on with the other lines)."""

    code = "input.invalid"


@dataclass(frozen=True)
class BadLine:
    """An input line that cannot run, and why."""

    line: int
    id: str | int | None
    message: str

    def to_record(self) -> dict[str, Any]:
        """Its ``failures.jsonl`` line."""
        return {
            "id": self.id,
            "line": self.line,
            "error": {"code": InvalidInputLine.code, "message": self.message},
        }


def read_inputs(path: Path) -> tuple[list[BatchRequest], list[BadLine]]:
    """Every runnable line of ``path`` and every bad one, in file order."""
    try:
        handle = path.open("rb")
    except OSError as exc:
        raise ConfigError(
            f"cannot read the input file: {exc.strerror}", location=Location(str(path))
        ) from None
    requests: list[BatchRequest] = []
    bad: list[BadLine] = []
    first_line: dict[str, int] = {}
    with handle:
        for number, raw in enumerate(handle, 1):
            if not raw.strip():
                continue
            try:
                requests.append(_parse(raw, number, first_line))
            except _Bad as exc:
                bad.append(BadLine(number, exc.id, str(exc)))
    return requests, bad


class _Bad(Exception):
    def __init__(self, message: str, id: str | int | None = None) -> None:
        super().__init__(message)
        self.id = id


def _parse(raw: bytes, number: int, first_line: dict[str, int]) -> BatchRequest:
    try:
        data = json_text.loads(raw)  # bounded nesting, UTF-8 text
    except RequestError as exc:
        raise _Bad(exc.message) from None
    if not isinstance(data, dict):
        raise _Bad(f"a line must be a JSON object, got {type(data).__name__}")
    request_id = data.pop("id", None)
    if request_id is None:
        raise _Bad("missing 'id'")
    if isinstance(request_id, bool) or not isinstance(request_id, str | int) or request_id == "":
        raise _Bad(f"'id' must be a non-empty string or an integer, got {request_id!r}")
    key = str(request_id)
    if key in first_line:
        raise _Bad(f"id {request_id!r} repeats line {first_line[key]}", request_id)
    first_line[key] = number
    return BatchRequest(request_id, number, _endpoint(data, request_id), data)


def _endpoint(params: dict[str, Any], request_id: str | int) -> str:
    """The endpoint for the line's fields, or :class:`_Bad` saying what is wrong."""
    has_prompt, has_messages = "prompt" in params, "messages" in params
    if has_prompt == has_messages:
        which = "both" if has_prompt else "neither"
        raise _Bad(f"give either 'prompt' or 'messages', got {which}", request_id)
    if "model" in params:
        raise _Bad("'model' comes from the task's model_alias; remove it from the line", request_id)
    if params.get("stream"):
        raise _Bad("'stream' is not supported in a batch run; remove it", request_id)
    if has_messages:
        messages = params["messages"]
        if not isinstance(messages, list) or not messages:
            raise _Bad("'messages' must be a non-empty list of messages", request_id)
        return CHAT_COMPLETIONS
    if not isinstance(params["prompt"], str | list):
        raise _Bad("'prompt' must be a string or a list", request_id)
    return COMPLETIONS
