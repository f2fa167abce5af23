"""The serving errors and the one mapping of an error to its HTTP answer in OpenAI's shape.

Every error an endpoint answers goes through :func:`error_status_and_body`, the one place that
turns a :class:`KunlunError` into the OpenAI error shape::

    {"error": {"message": ..., "type": ..., "param": ..., "code": ...}}

from the entry each error class declares (:class:`kunlun.errors.KunlunError`: ``http_status``,
``openai_type``, ``openai_code``; ``tests/test_error_catalog.py`` walks them all). The serving
errors below extend the project hierarchy (:mod:`kunlun.errors`).

Apart from the request models (:mod:`kunlun.protocol.openai_api`): the daemon's edges (API
keys, routing failures, the admin API's JSON check) answer with these too.
"""

from __future__ import annotations

import json
from typing import Any

from kunlun.errors import KunlunError, Location, RequestError

# ---- serving errors ----


class ModelNotFound(RequestError):
    """The request names a model that nothing here serves."""

    code = "serving.model_not_found"
    openai_code = "model_not_found"
    http_status = 404
    openai_type = "invalid_request_error"


class RouteNotFound(RequestError):
    """No route answers this path."""

    code = "serving.not_found"
    openai_code = "not_found"
    http_status = 404
    openai_type = "invalid_request_error"


class MethodNotAllowed(RequestError):
    """The path exists, but not for this HTTP method."""

    code = "serving.method_not_allowed"
    openai_code = "method_not_allowed"
    http_status = 405
    openai_type = "invalid_request_error"


def http_error(status: int, method: str, path: str, detail: str) -> KunlunError:
    """The error that answers a routing failure (``status`` 404, 405 or another) of
    ``method path`` in OpenAI's shape."""
    if status == 404:
        return RouteNotFound(f"{method} {path}: no such route (see GET /docs for the API)")
    if status == 405:
        return MethodNotAllowed(f"{method} {path}: method not allowed on this route")
    error = RequestError(f"{method} {path}: {detail}")
    error.http_status = status
    error.openai_type = "invalid_request_error" if status < 500 else "server_error"
    return error


class BodyTooLarge(RequestError):
    """The request body is larger than the gateway accepts."""

    code = "serving.body_too_large"
    http_status = 413
    openai_type = "invalid_request_error"


class AuthenticationError(KunlunError):
    """The API key is missing or wrong."""

    code = "serving.invalid_api_key"
    openai_code = "invalid_api_key"
    exit_code = 2
    http_status = 401
    openai_type = "authentication_error"


class _RetryLater(KunlunError):
    def __init__(self, message: str, *, retry_after_s: int = 1, hint: str | None = None) -> None:
        super().__init__(message, hint=hint)
        self.retry_after_s = retry_after_s
        """Seconds a client should wait before retrying (the ``Retry-After`` header)."""


class QueueFull(_RetryLater):
    """Every replica of the model has its queue full."""

    code = "serving.queue_full"
    openai_code = "rate_limit_exceeded"
    http_status = 429
    openai_type = "rate_limit_error"


class RateLimited(_RetryLater):
    """The API key has used its requests or tokens per minute (:mod:`kunlun.serving.key_limits`)."""

    code = "serving.rate_limited"
    openai_code = "rate_limit_exceeded"
    http_status = 429
    openai_type = "rate_limit_error"


class ServiceUnavailable(_RetryLater):
    """No replica can take the request now (none ready, or the platform is draining)."""

    code = "serving.unavailable"
    openai_code = "service_unavailable"
    http_status = 503
    openai_type = "service_unavailable_error"


class WorkerDied(KunlunError):
    """The engine worker serving a request stopped before answering it."""

    code = "serving.worker_died"
    openai_code = "worker_died"
    http_status = 502
    openai_type = "server_error"


class WorkerUnresponsive(KunlunError):
    """The engine worker serving a request stopped answering (it missed its liveness or
    progress deadline, or an upstream read timed out)."""

    code = "serving.worker_unresponsive"
    openai_code = "worker_unresponsive"
    http_status = 504
    openai_type = "timeout_error"


# ---- errors -> OpenAI shape, in one place ----


def error_status_and_body(exc: BaseException) -> tuple[int, dict[str, Any], dict[str, str]]:
    """The HTTP status, OpenAI-shaped body and extra headers that answer ``exc``.

    A :class:`KunlunError` answers its ``http_status``; anything else is a 500 naming the
    exception type (it is a bug).
    """
    if not isinstance(exc, KunlunError):
        exc = KunlunError(f"internal error: {type(exc).__name__}: {exc}")
    status = exc.http_status
    code = exc.openai_code or exc.code
    where = exc.location
    message = exc.message if where is None or where.path == "request" else f"{where}: {exc.message}"
    if exc.hint:
        message = f"{message} (hint: {exc.hint})"
    body = {
        "error": {
            "message": message,
            "type": exc.openai_type,
            "param": where.field if where is not None else None,
            "code": code,
        }
    }
    retry_after = getattr(exc, "retry_after_s", None)
    headers = {"Retry-After": str(retry_after)} if retry_after is not None else {}
    return status, body, headers


def error_json(exc: BaseException) -> bytes:
    """The OpenAI-shaped error body of ``exc`` as JSON bytes (for SSE error events)."""
    return json.dumps(error_status_and_body(exc)[1], ensure_ascii=False).encode()


def param_error(param: str, message: str) -> RequestError:
    """A :class:`RequestError` about one request field (it becomes the error's ``param``)."""
    return RequestError(message, location=Location("request", field=param))
