"""The daemon's request log: one JSON line per finished ``/v1`` request, and per request to
the other inference routes (SGLang's ``/generate``, Ollama's ``/api/chat``...).

``KUNLUN_HOME/logs/requests.jsonl`` gets ``{ts, request_id, method, path, model, status,
latency_ms}`` when a request's response has been sent (or the request ended without one,
``status`` null). ``request_id`` is the one the response carried (``X-Request-Id``: the
client's own, or the one the gateway made up); ``model`` is what the gateway read from the
body (it leaves it in the request's ASGI state). This is how an operator, or a test, sees
exactly which requests arrived: e.g. that a resumed batch did not send a finished id again.

The middleware is plain ASGI, so streamed responses pass through untouched. It only queues
the entry in memory: a writer thread encodes and appends the queued entries in one write
and one fsync at most every :attr:`RequestLogConfig.flush_interval_s` (sooner when many are
waiting), so the event loop never touches the disk. :meth:`RequestLog.close` (the daemon's
shutdown, after the SIGTERM drain) writes whatever is left. Past
:attr:`RequestLogConfig.max_bytes` the file is rotated: ``requests.jsonl`` becomes
``requests.jsonl.1``, ``.1`` becomes ``.2``, ... and the oldest beyond
:attr:`RequestLogConfig.num_backups` is removed. A failing write (disk full, permissions)
never reaches a request: it is reported once on stderr with the path and errno, the entries
of that batch are dropped and counted, and writing resumes when the disk allows. No entry
can stop the writer: text UTF-8 cannot hold (a lone surrogate from a client) is written as
its ``\\uXXXX`` escape (:func:`~kunlun.json_text.dumps_line`), and an entry JSON cannot
hold at all is dropped, counted and reported once; the entries after it are written.

A request whose client disconnected before its answer was complete (while it waited in the
gateway's queue, or in the middle of a stream) is logged with ``status`` 499 (client closed
request), whatever status line had already been sent.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kunlun import headers as http_headers
from kunlun.json_text import dumps_line
from kunlun.limits import CLIENT_GONE
from kunlun.serving.gateway import ENDPOINTS

PREFIX = "/v1/"

_REQUEST_ID = http_headers.raw(http_headers.REQUEST_ID)


@dataclass(frozen=True)
class RequestLogConfig:
    """How the request log is written and rotated (``kunlun-platform --request-log-*``)."""

    max_bytes: int = 64 << 20
    """Rotate once the file would pass this size (>= 1); 64 MiB by default."""
    num_backups: int = 5
    """Rotated files kept (``requests.jsonl.1`` newest ... ``.N`` oldest); 0 keeps none."""
    flush_interval_s: float = 0.5
    """Longest time an entry waits in memory before it is written (> 0)."""
    flush_at_entries: int = 512
    """Write sooner once this many entries wait."""
    max_pending: int = 100_000
    """Entries held while the disk cannot keep up; more are dropped (and counted)."""


class RequestLog:
    """Queues entries (:meth:`write`, called on the event loop) for a writer thread that
    appends them to :attr:`path` in batches; :meth:`close` writes the rest and stops it."""

    def __init__(self, path: Path, config: RequestLogConfig | None = None) -> None:
        self.path = path
        self.config = config or RequestLogConfig()
        self.num_written = 0
        """Entries written so far."""
        self.num_dropped = 0
        """Entries lost to write errors, a full queue or a value JSON cannot hold."""
        self.num_unwritable = 0
        """Entries dropped because JSON cannot hold one of their values (reported once)."""
        self._pending: deque[dict[str, Any]] = deque()
        """Appended by :meth:`write`, drained by the writer (a deque: both thread-safe)."""
        self._wake = threading.Event()
        """Set to write before the interval ends: many entries wait, or closing."""
        self._start_lock = threading.Lock()
        self._io_lock = threading.Lock()
        """Held by whoever writes the file (the writer thread, or :meth:`close`)."""
        self._closed = False
        self._thread: threading.Thread | None = None
        self._file: IO[bytes] | None = None
        self._size = 0
        self._failing = False
        """A write failed and was reported; the next success says so and clears it."""
        self._broken = False
        """An unexpected error was reported (once)."""

    def write(self, entry: dict[str, Any]) -> None:
        """Queue one entry (cheap: a deque append; no lock, no encoding, no I/O here)."""
        pending = self._pending
        if len(pending) >= self.config.max_pending:
            self.num_dropped += 1
            return
        pending.append(entry)
        if self._thread is None:
            self._start()
        elif len(pending) >= self.config.flush_at_entries:
            self._wake.set()
        if self._closed:  # after close: write at once, so nothing is lost
            self._flush()

    def close(self) -> None:
        """Write every queued entry, stop the writer and close the file (idempotent)."""
        with self._start_lock:
            self._closed = True
            thread = self._thread
        self._wake.set()
        if thread is not None and thread is not threading.current_thread():
            thread.join()
        atexit.unregister(self.close)
        self._flush()
        with self._io_lock:
            self._close_file()

    def _start(self) -> None:
        with self._start_lock:
            if self._thread is not None or self._closed:
                return
            self._thread = threading.Thread(
                target=self._run, name="kunlun-request-log", daemon=True
            )
            self._thread.start()
        atexit.register(self.close)  # a shutdown that skips the daemon's lifespan still writes

    # ---- the writer thread ----
    def _run(self) -> None:
        while True:
            self._wake.wait(self.config.flush_interval_s)
            self._wake.clear()  # a set() lost to this race only waits for the next interval
            closed = self._closed
            self._flush()
            if closed:
                return

    def _flush(self) -> None:
        with self._io_lock:
            pending = self._pending
            entries = [pending.popleft() for _ in range(len(pending))]
            if not entries:
                return
            try:
                self._write_entries(entries)
            except Exception as exc:  # a bug must not stop the writer: report, count, go on
                self.num_dropped += len(entries)
                self._close_file()
                if not self._broken:
                    self._broken = True
                    print(
                        f"request log: writing {self.path} failed ({type(exc).__name__}: "
                        f"{exc}); {len(entries)} entries dropped, writing goes on",
                        file=sys.stderr,
                        flush=True,
                    )

    def _write_entries(self, entries: list[dict[str, Any]]) -> None:
        lines = []
        for entry in entries:
            try:
                lines.append(dumps_line(entry))
            except (TypeError, ValueError) as exc:  # a value JSON cannot hold: drop this one
                self._drop_unwritable(entry, exc)
        try:
            self._append(lines)
        except OSError as exc:
            self.num_dropped += len(lines)
            self._close_file()
            if not self._failing:
                self._failing = True
                print(
                    f"request log: cannot write {self.path}: [Errno {exc.errno}] {exc.strerror}; "
                    "entries are dropped until it can be written again (serving continues)",
                    file=sys.stderr,
                    flush=True,
                )
            return
        self.num_written += len(lines)
        if self._failing:
            self._failing = False
            print(f"request log: writing {self.path} again", file=sys.stderr, flush=True)

    def _drop_unwritable(self, entry: dict[str, Any], exc: Exception) -> None:
        """Count an entry that cannot be written as JSON; report the first one."""
        self.num_dropped += 1
        self.num_unwritable += 1
        if self.num_unwritable == 1:
            print(
                f"request log: an entry cannot be written to {self.path} and is dropped "
                f"({type(exc).__name__}: {exc}; keys {sorted(entry)}); later entries are "
                "written, further such entries are only counted",
                file=sys.stderr,
                flush=True,
            )

    def _append(self, lines: list[bytes]) -> None:
        """Write ``lines`` in as few writes as rotation allows, then fsync."""
        chunk: list[bytes] = []
        size = self._open()
        for line in lines:
            if size > 0 and size + len(line) > self.config.max_bytes:
                self._write(chunk)
                chunk = []
                self._rotate()
                size = self._open()
            chunk.append(line)
            size += len(line)
        self._write(chunk)
        assert self._file is not None  # opened above
        os.fsync(self._file.fileno())

    def _open(self) -> int:
        """The open file's size (opening it, appending, when needed)."""
        if self._file is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._file = self.path.open("ab")
            self._size = self._file.tell()
        return self._size

    def _write(self, chunk: list[bytes]) -> None:
        if chunk and self._file is not None:
            data = b"".join(chunk)
            self._file.write(data)
            self._file.flush()
            self._size += len(data)

    def _rotate(self) -> None:
        """``path`` -> ``path.1`` -> ... -> ``path.N``; the oldest beyond N goes."""
        assert self._file is not None
        os.fsync(self._file.fileno())
        self._close_file()
        keep = self.config.num_backups
        if keep == 0:
            self.path.unlink(missing_ok=True)
            return
        self._backup(keep).unlink(missing_ok=True)
        for n in range(keep - 1, 0, -1):
            if self._backup(n).exists():
                os.replace(self._backup(n), self._backup(n + 1))
        os.replace(self.path, self._backup(1))

    def _backup(self, n: int) -> Path:
        return self.path.with_name(f"{self.path.name}.{n}")

    def _close_file(self) -> None:
        if self._file is not None:
            with contextlib.suppress(OSError):  # unwritable buffered bytes: counted as dropped
                self._file.close()
            self._file = None


class RequestLogMiddleware:
    """Wraps an ASGI app; logs every HTTP request whose path starts with ``/v1/``."""

    def __init__(self, app: ASGIApp, log: RequestLog) -> None:
        self.app = app
        self.log = log

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not (
            scope["path"].startswith(PREFIX) or scope["path"] in ENDPOINTS
        ):
            await self.app(scope, receive, send)
            return
        started = time.monotonic()
        status: int | None = None
        request_id = _header(scope.get("headers", ()), _REQUEST_ID)
        complete = left = False

        async def logged_send(message: Message) -> None:
            nonlocal status, request_id, complete
            if message["type"] == "http.response.start":
                status = message["status"]
                request_id = _header(message.get("headers", ()), _REQUEST_ID) or request_id
            elif message["type"] == "http.response.body" and not message.get("more_body"):
                complete = True
            await send(message)

        async def watched_receive() -> Message:
            nonlocal left
            message = await receive()
            if message["type"] == "http.disconnect":
                left = True
            return message

        try:
            await self.app(scope, watched_receive, logged_send)
        finally:
            if left and not complete:
                status = CLIENT_GONE
            self.log.write(
                {
                    "ts": round(time.time(), 3),
                    "request_id": request_id,
                    "method": scope["method"],
                    "path": scope["path"],
                    "model": (scope.get("state") or {}).get("model"),
                    "status": status,
                    "latency_ms": round((time.monotonic() - started) * 1000, 2),
                }
            )


def _header(headers: Any, name: bytes) -> str | None:
    for key, value in headers:
        if key.lower() == name:
            return bytes(value).decode("latin-1")
    return None
