"""The OpenAI shapes of the Batch API: the ``batch`` object, ``errors.data`` entries, and
the lines of a batch's output and error files."""

from __future__ import annotations

import json
import secrets
from collections.abc import Mapping
from typing import Any

from kunlun.errors import KunlunError
from kunlun.state.store import BatchRecord

TERMINAL = frozenset({"completed", "failed", "expired", "cancelled"})
"""Statuses a job never leaves."""


def batch_object(record: BatchRecord) -> dict[str, Any]:
    """The OpenAI ``batch`` object. Output and error files are shown once the job ended."""
    ended = record.status in TERMINAL
    failed = record.request_counts.get("failed", 0)
    return {
        "id": record.batch_id,
        "object": "batch",
        "endpoint": record.endpoint,
        "errors": {"object": "list", "data": record.errors} if record.errors else None,
        "input_file_id": record.input_file_id,
        "completion_window": record.completion_window,
        "status": record.status,
        "output_file_id": record.output_file_id if ended else None,
        "error_file_id": record.error_file_id if ended and failed else None,
        "created_at": record.created_at,
        "in_progress_at": record.in_progress_at,
        "expires_at": record.expires_at,
        "finalizing_at": record.finalizing_at,
        "completed_at": record.completed_at,
        "failed_at": record.failed_at,
        "expired_at": record.expired_at,
        "cancelling_at": record.cancelling_at,
        "cancelled_at": record.cancelled_at,
        "request_counts": {
            "total": record.request_counts.get("total", 0),
            "completed": record.request_counts.get("completed", 0),
            "failed": failed,
        },
        "metadata": record.metadata,
        "model": record.model,
        "usage": usage_object(record.usage),
    }


USAGE_FIELDS = ("prompt_tokens", "cached_tokens", "completion_tokens", "total_tokens")


def add_usage(totals: dict[str, int], line: Mapping[str, Any]) -> None:
    """Add an output line's ``response.body.usage`` to ``totals`` (keys :data:`USAGE_FIELDS`)."""
    body = (line.get("response") or {}).get("body")
    usage = body.get("usage") if isinstance(body, dict) else None
    if not isinstance(usage, dict):
        return
    details = usage.get("prompt_tokens_details") or {}
    found = {
        "prompt_tokens": usage.get("prompt_tokens"),
        "cached_tokens": details.get("cached_tokens") if isinstance(details, dict) else None,
        "completion_tokens": usage.get("completion_tokens"),
        "total_tokens": usage.get("total_tokens"),
    }
    for name, value in found.items():
        if isinstance(value, int):
            totals[name] = totals.get(name, 0) + value


def token_usage(lines: list[dict[str, Any]]) -> dict[str, int]:
    """The token totals of a batch's output lines."""
    totals = dict.fromkeys(USAGE_FIELDS, 0)
    for line in lines:
        add_usage(totals, line)
    return totals


def usage_object(totals: dict[str, int]) -> dict[str, Any] | None:
    """The batch object's ``usage`` (OpenAI's input/output naming); None before any count."""
    if not totals:
        return None
    return {
        "input_tokens": totals.get("prompt_tokens", 0),
        "input_tokens_details": {"cached_tokens": totals.get("cached_tokens", 0)},
        "output_tokens": totals.get("completion_tokens", 0),
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": totals.get("total_tokens", 0),
    }


def answer_line(
    custom_id: str, request_id: str, status: int, headers: Mapping[str, str], body: bytes
) -> dict[str, Any]:
    """The output (2xx) or error file line of an answered request."""
    try:
        payload: Any = json.loads(body)
    except (ValueError, RecursionError):  # not JSON, or nested past the parser: kept as text
        payload = body.decode("utf-8", errors="replace")
    return {
        "id": _request_line_id(),
        "custom_id": custom_id,
        "response": {
            "status_code": status,
            "request_id": headers.get("x-request-id", request_id),
            "body": payload,
        },
        "error": None,
    }


class BatchRequestFailed(KunlunError):
    """A batch request that got no answer at all: its line of the error file carries this
    code (OpenAI's spelling)."""

    code = "request_failed"
    http_status = 502


def failure_line(custom_id: str, message: str) -> dict[str, Any]:
    """The error file line of a request that got no answer at all."""
    return {
        "id": _request_line_id(),
        "custom_id": custom_id,
        "response": None,
        "error": {"code": BatchRequestFailed.code, "message": message},
    }


def batch_error(
    code: str, message: str, line: int | None = None, param: str | None = None
) -> dict[str, Any]:
    """One entry of a batch's ``errors.data``."""
    return {"code": code, "message": message, "line": line, "param": param}


def _request_line_id() -> str:
    return "batch_req_" + secrets.token_hex(12)
