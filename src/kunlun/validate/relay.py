"""A loopback relay that points a tool which only takes an endpoint at one device pool.

The batch runner (``kunlun-cli batch run --endpoint URL``) has no way to send
``X-Kunlun-Pool``; on a pool column the battery starts a :class:`PoolRelay` on
``127.0.0.1`` and gives the runner its address instead. Each request is sent on through the
column's :class:`TargetClient` (which adds the pool header and the API key), and the
answer comes back whole: status, body, ``Content-Type``, ``X-Request-Id`` and
``X-Kunlun-Device``, which the client also counts for the routing row. Answers are
buffered, which suits the batch runner's non-streamed requests.
"""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import TracebackType

import httpx

from kunlun import headers as http_headers
from kunlun.validate.client import TargetClient
from kunlun.validate.target import DEVICE_HEADER

_PASSED_ON = ("content-type", http_headers.REQUEST_ID.lower())
_PASSED_BACK = (
    "content-type",
    http_headers.REQUEST_ID.lower(),
    DEVICE_HEADER.lower(),
    "retry-after",
)


class PoolRelay:
    """``with PoolRelay(client) as url:`` relays ``url`` to the client's target and pool."""

    def __init__(self, client: TargetClient) -> None:
        self.client = client
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def __enter__(self) -> str:
        self._thread.start()
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(10)

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        client = self.client

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                self._relay("GET")

            def do_POST(self) -> None:
                self._relay("POST")

            def _relay(self, method: str) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                headers = {k: v for k, v in self.headers.items() if k.lower() in _PASSED_ON}
                try:
                    resp = client.http.request(method, self.path, content=body, headers=headers)
                except httpx.HTTPError as exc:
                    self.send_error(502, f"relay: {type(exc).__name__}: {exc}")
                    return
                client.saw(self.path, resp)
                self.send_response(resp.status_code)
                for key in _PASSED_BACK:
                    if key in resp.headers:
                        self.send_header(key, resp.headers[key])
                self.send_header("Content-Length", str(len(resp.content)))
                self.end_headers()
                self.wfile.write(resp.content)

            def log_message(self, format: str, *args: object) -> None:
                pass  # the battery reports; no access log on stderr

        return Handler
