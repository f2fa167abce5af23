"""The watch of :meth:`kunlun.state.etcd_client.Etcd.watch`: one prefix's events streamed from
``/v3/watch`` in a thread, resumed on the next member after the last delivered revision,
reopened when idle for :data:`WATCH_IDLE_S`, closed at once when its ``stop`` is set."""

from __future__ import annotations

import contextlib
import json
import logging
import socket
import threading
from collections.abc import Callable
from typing import Any

import httpx

from kunlun.state.etcd_client import Etcd
from kunlun.state.etcd_wire import WatchEvent, error_of, event_of, key_span, revision_of

log = logging.getLogger(__name__)

WATCH_IDLE_S = 15.0
"""A watch stream silent for this long is reopened (a member that vanished without a reset)."""
_BACKOFF_MIN_S, _BACKOFF_MAX_S = 0.1, 2.0


class Watch:
    """One watch's state: where to resume, the open stream's socket (to shut it)."""

    def __init__(
        self,
        etcd: Etcd,
        prefix: str,
        start_revision: int,
        on_events: Callable[[list[WatchEvent], int], None],
        stop: threading.Event,
    ) -> None:
        self.etcd, self.prefix, self.on_events, self.stop = etcd, prefix, on_events, stop
        self.next_revision = start_revision
        self._socket: socket.socket | None = None
        self._lock = threading.Lock()
        self._closed = False

    def run(self) -> None:
        self.etcd._register(self, True)
        closer = threading.Thread(target=self._shut_on_stop, daemon=True)
        closer.start()
        index, delay = self.etcd._preferred, _BACKOFF_MIN_S
        try:
            while not self._done():
                endpoint = self.etcd.endpoints[index % len(self.etcd.endpoints)]
                try:
                    self._stream(endpoint)
                    continue  # ended on purpose (a compaction, an idle stream): same endpoint
                except Progressed as exc:  # worked for a while, then broke
                    log.info("etcd watch on %s broke: %s", endpoint, exc.cause)
                    delay = _BACKOFF_MIN_S
                except Exception as exc:  # a refused, broken or unreadable stream
                    log.info("etcd watch on %s failed: %s", endpoint, exc)
                    delay = min(2 * delay, _BACKOFF_MAX_S)
                index += 1
                self.stop.wait(delay)
        finally:
            self.shut()
            self.etcd._register(self, False)

    def shut(self) -> None:
        """End the watch: shut its socket down, waking the thread blocked reading it."""
        with self._lock:
            self._closed = True
            if self._socket is not None:
                # socket.socket's shutdown, not SSLSocket's (which would unwrap TLS)
                with contextlib.suppress(OSError):
                    socket.socket.shutdown(self._socket, socket.SHUT_RDWR)

    def _done(self) -> bool:
        return self._closed or self.stop.is_set()

    def _shut_on_stop(self) -> None:
        while not self.stop.wait(0.25):
            if self._closed:
                return
        self.shut()

    def _stream(self, endpoint: str) -> None:
        """Read one stream; returns when it ended on purpose, raises when it broke
        (:class:`Progressed` when it delivered something first)."""
        create = {**key_span(self.prefix, True), "start_revision": str(self.next_revision)}
        timeout = httpx.Timeout(self.etcd.timeout_s, read=WATCH_IDLE_S)
        body = {"create_request": {**create, "progress_notify": True}}
        progressed = False
        client = self.etcd._client
        with client.stream("POST", endpoint + "/v3/watch", json=body, timeout=timeout) as response:
            if response.status_code != 200:
                response.read()
                raise Broken(f"HTTP {response.status_code}: {response.text[:200]}")
            stream = response.extensions.get("network_stream")
            with self._lock:
                if self._closed:
                    return
                self._socket = stream.get_extra_info("socket") if stream else None
            try:
                for line in response.iter_lines():
                    if self._done():
                        return
                    if line.strip() and not self._handle(json.loads(line)):
                        return
                    progressed = True
            except httpx.ReadTimeout:
                return  # idle for WATCH_IDLE_S: reopen
            except Exception as exc:
                if progressed and not self._done():
                    raise Progressed(exc) from exc
                raise
            finally:
                with self._lock:
                    self._socket = None
        if not self._done():
            raise Progressed(Broken("the stream ended")) if progressed else Broken("no answer")

    def _handle(self, message: dict[str, Any]) -> bool:
        """Deliver one message of the stream; False when the stream must be reopened."""
        error = error_of(message)
        if error is not None:
            raise Broken(error[1])
        result = message.get("result", {})
        if result.get("canceled"):
            compacted = int(result.get("compact_revision", 0))
            if compacted <= 0:
                raise Broken(result.get("cancel_reason") or "the watch was canceled")
            self._deliver([], -compacted)
            self.next_revision = compacted
            return False
        if result.get("created"):
            return True
        events = [event_of(e) for e in result.get("events", [])]
        revision = revision_of(result)
        if events:
            self.next_revision = events[-1].kv.mod_revision + 1
        else:
            self.next_revision = max(self.next_revision, revision + 1)
        self._deliver(events, revision)
        return True

    def _deliver(self, events: list[WatchEvent], revision: int) -> None:
        try:
            self.on_events(events, revision)
        except Exception:
            log.exception("etcd watch callback for %s failed", self.prefix)


class Broken(Exception):
    """A watch stream failed."""


class Progressed(Exception):
    """A watch stream broke after delivering something (so try the next member at once)."""

    def __init__(self, cause: Exception) -> None:
        super().__init__(str(cause))
        self.cause = cause
