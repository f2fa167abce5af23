"""JSON text at the platform's edges: read it within bounds, write it so it always encodes.

Everything a client or a file sends as JSON (an inference body, a batch input line, an admin
body) is read with :func:`loads`, which refuses, with a :class:`~kunlun.errors.RequestError`
(HTTP 400) naming the place, what Python's own parser would turn into a crash later:

- nesting deeper than :data:`MAX_DEPTH` arrays and objects (Python's parser recurses, so a
  few thousand levels raise ``RecursionError``); the depth is measured on the raw text,
  without recursion, before anything is parsed;
- a string that UTF-8 cannot hold: a lone surrogate, written ``"\\ud800"`` in JSON, which
  Python's parser accepts and every later ``.encode()`` (a log line, a database row, an HTTP
  header) refuses. The error names the field (``messages.0.content``, or ``custom_id``).

Both checks cost one byte scan in C for ordinary bodies; the walk over the parsed values
that names a field runs only when the scan finds something to look at.

:func:`dumps_line` writes one JSON line as UTF-8 bytes for logs and journals: a string that
UTF-8 cannot hold is written as its ``\\uXXXX`` escape (still valid JSON), so no value can
make a writer fail.
"""

from __future__ import annotations

import json
import re
from typing import Any

from kunlun.budgets import BUDGETS, limit
from kunlun.errors import Location, RequestError

MAX_DEPTH = int(BUDGETS["json_depth"].default)
"""Deepest nesting of arrays and objects accepted by default (an OpenAI request needs about
5); ``KUNLUN_BUDGET_JSON_DEPTH`` changes it (:mod:`kunlun.budgets`)."""

_DROP = bytes(b for b in range(256) if b not in b'"[]{}')
"""Every byte but quotes and brackets: what the depth scan drops first."""
_STRING = re.compile(rb'"[^"]*"')


def loads(
    raw: bytes | str, source: str = "request", line: int | None = None, field: str | None = None
) -> Any:
    """Parse ``raw`` (a JSON document), refusing too deep nesting and text that UTF-8 cannot
    hold; errors are :class:`RequestError` located at ``source`` (``"request"`` for a
    request body, else a file name) and ``line``, naming the field when there is one.
    ``field`` names a string field whose value is JSON text (``guided_json`` given as a
    string): it is read within the same bounds, and its errors name it."""
    if isinstance(raw, str):
        raw = raw.encode("utf-8", "surrogatepass")
    depth = int(limit("json_depth"))
    if raw.count(b"[") + raw.count(b"{") > depth and nesting_depth(raw, depth) > depth:
        raise _too_deep(source, line, depth, field)
    try:
        value = json.loads(raw)
    except ValueError as exc:  # UnicodeDecodeError too
        what = f"'{field}' is not valid JSON" if field else "not valid JSON"
        raise RequestError(f"{what}: {exc}", location=Location(source, line, field)) from None
    except RecursionError:  # unclosed brackets, which the depth scan does not count
        raise _too_deep(source, line, depth, field) from None
    if b"\\ud" in raw or b"\\uD" in raw or b"\xed" in raw:  # a surrogate, maybe
        field = unencodable_field(value)
        if field is not None:
            raise RequestError(
                f"'{field or '(the body)'}' holds text that is not valid Unicode (a lone "
                "surrogate such as \\ud800); send UTF-8 text",
                location=Location(source, line, field or None),
            )
    return value


def _too_deep(source: str, line: int | None, depth: int, field: str | None) -> RequestError:
    inside = f" in '{field}'" if field else ""
    return RequestError(
        f"JSON nested more than {depth} levels deep{inside}; at most {depth} levels of "
        "arrays and objects are accepted",
        location=Location(source, line, field),
    )


def nesting_depth(raw: bytes, limit: int = MAX_DEPTH) -> int:
    """The deepest nesting of arrays and objects in the JSON text ``raw``, counted up to
    ``limit + 1``, without recursion and in C-speed passes, linear in ``raw`` whatever its
    shape: drop escaped quotes, every byte but quotes and brackets, and the strings; then
    the deepest running count of openings less closings. (Brackets left open count as open.)"""
    text = raw.replace(b"\\\\", b"").replace(b'\\"', b"").translate(None, _DROP)
    text = _STRING.sub(b"", text)
    if not text:
        return 0
    import numpy as np  # here: most documents never get this far, and every daemon, worker
    # and CLI call imports this module (numpy costs 0.1-0.2 s of CPU to import)

    brackets = np.frombuffer(text, dtype=np.uint8)
    opens = (brackets == ord("[")) | (brackets == ord("{"))
    closes = (brackets == ord("]")) | (brackets == ord("}"))
    running = np.cumsum(opens.astype(np.int64) - closes.astype(np.int64))
    return int(min(max(int(running.max()), 0), limit + 1))


def unencodable_field(value: Any) -> str | None:
    """The dotted path (``messages.0.content``; ``""`` for the value itself) of the first
    string or key in ``value`` that UTF-8 cannot encode, or None when every one can.
    Iterative, so any depth is safe."""
    stack: list[tuple[str, Any]] = [("", value)]
    while stack:
        path, item = stack.pop()
        if isinstance(item, str):
            if not _encodes(item):
                return path
        elif isinstance(item, dict):
            for key, child in item.items():
                child_path = f"{path}.{key}" if path else str(key)
                if not _encodes(key):  # the path names the key, escaped
                    return child_path.encode("utf-8", "backslashreplace").decode()
                stack.append((child_path, child))
        elif isinstance(item, list):
            stack.extend((f"{path}.{i}" if path else str(i), child) for i, child in enumerate(item))
    return None


def _encodes(text: str) -> bool:
    if text.isascii():
        return True
    try:
        text.encode()
    except UnicodeEncodeError:
        return False
    return True


def dumps_line(record: Any) -> bytes:
    """``record`` as one JSON line (UTF-8, newline-terminated); a string UTF-8 cannot hold is
    written as its ``\\uXXXX`` escape, so this never fails on text."""
    return (json.dumps(record, ensure_ascii=False) + "\n").encode("utf-8", "backslashreplace")
