"""Values of the daemon's JSON as a page shows them: nested objects as dotted rows, never as
a Python ``repr`` (``{'kv': {'blocks': 12}}`` on a page is a dump, not an answer)."""

from __future__ import annotations

from typing import Any

MAX_ROWS = 200
"""Rows :func:`rows` returns at most (a plan has a few dozen)."""


def text(value: Any) -> str:
    """One value on one line: scalars as written, lists joined by commas, objects as
    ``key=value`` pairs; None as a dash."""
    if value is None:
        return "–"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return f"{value:g}"
    if isinstance(value, dict):
        return ", ".join(f"{k}={text(v)}" for k, v in value.items()) or "–"
    if isinstance(value, list | tuple):
        return ", ".join(text(v) for v in value) or "none"
    return str(value)


def rows(value: Any, prefix: str = "") -> list[tuple[str, str]]:
    """``value`` (an object) as (dotted key, :func:`text`) rows, nested objects flattened."""
    out: list[tuple[str, str]] = []
    if not isinstance(value, dict):
        return [(prefix or "value", text(value))]
    for key, item in value.items():
        name = f"{prefix}.{key}" if prefix else str(key)
        if isinstance(item, dict) and item:
            out += rows(item, name)
        else:
            out.append((name, text(item)))
        if len(out) >= MAX_ROWS:
            return out[:MAX_ROWS]
    return out
