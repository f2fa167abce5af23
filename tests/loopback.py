"""The tests' own HTTP requests to daemons, workers and proxies on loopback.

``httpx.get()`` and its siblings build a client per call, and building one loads the CA
bundle into a new TLS context: about 28 ms of CPU per call, which the polling loops pay
every 0.1 s (a fifth of a core while a test waits for a daemon, on a machine where the suite
is bound by CPU). These functions behave as httpx's do (a fresh client, so no cookie or
connection outlives the call) but share one transport, built once per process, whose pool
keeps no connection alive. For TLS options (``verify``, ``cert``) use httpx itself.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import httpx

_TRANSPORT = httpx.HTTPTransport(limits=httpx.Limits(max_keepalive_connections=0))


def _client() -> httpx.Client:
    # not closed after use: closing a client closes its transport, which is shared
    return httpx.Client(transport=_TRANSPORT)


def request(method: str, url: str, **kwargs: Any) -> httpx.Response:
    return _client().request(method, url, **kwargs)


def get(url: str, **kwargs: Any) -> httpx.Response:
    return request("GET", url, **kwargs)


def post(url: str, **kwargs: Any) -> httpx.Response:
    return request("POST", url, **kwargs)


def put(url: str, **kwargs: Any) -> httpx.Response:
    return request("PUT", url, **kwargs)


def delete(url: str, **kwargs: Any) -> httpx.Response:
    return request("DELETE", url, **kwargs)


@contextlib.contextmanager
def stream(method: str, url: str, **kwargs: Any) -> Iterator[httpx.Response]:
    with _client().stream(method, url, **kwargs) as response:
        yield response
