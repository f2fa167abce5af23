"""The gateway's answer to one admitted inference request: :class:`Relay`.

It is an ASGI response (built by :func:`kunlun.serving.gateway.respond`) that takes a
replica slot, sends the request to the replica's worker over the gateway's upstream pool
and relays the answer byte for byte, adding ``X-Kunlun-Replica``, ``X-Kunlun-Device`` and
``X-Kunlun-Priority``. A worker that dies mid-stream ends the client's stream with one SSE
error event (code ``worker_died``) and no ``[DONE]``, after the last whole event it sent (a
stream's bytes go on at event ends: a cut-off event would reach the client as broken JSON;
a direct stream's worker that dies with part of an event written to the client's connection
has the connection shut down after that part instead, :mod:`kunlun.serving.handoff`); one that dies or cannot be reached before answering has the request sent to another
replica of its model (and rollout version), at most :data:`MAX_RETRIES` times, and gives
502 or 503 when none is left; once the first byte went to the client nothing is retried. A worker the node agent killed for being unresponsive (``Replica.fault``), or one silent
past the upstream pool's first-byte or read timeout, gives 504 (code ``worker_unresponsive``)
the same ways. A client that disconnects closes the upstream response at once, which makes the worker
abort the generation; one still waiting in the queue is taken out of it.
"""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING, Any

from fastapi.responses import Response
from starlette.types import Receive, Scope, Send

from kunlun import headers as http_headers
from kunlun.engine.launch import EMBEDDED_ENGINE
from kunlun.errors import KunlunError
from kunlun.http_client import (
    UpstreamBroken,
    UpstreamError,
    UpstreamResponse,
    UpstreamTimeout,
    UpstreamUnreachable,
)
from kunlun.limits import CLIENT_GONE
from kunlun.protocol import sse
from kunlun.protocol.openai_errors import (
    QueueFull,
    ServiceUnavailable,
    WorkerDied,
    WorkerUnresponsive,
    error_status_and_body,
)
from kunlun.serving.admission import Ticket
from kunlun.serving.external import external_body
from kunlun.serving.handoff import DirectLink, client_socket, shut, wait_flushed
from kunlun.serving.replica import Replica

if TYPE_CHECKING:
    from kunlun.serving.gateway_state import GatewayState
    from kunlun.serving.response_state import Recorder

_REQUEST_ID, _REPLICA, _DEVICE, _PRIORITY, _VERSION = map(http_headers.raw, (
    http_headers.REQUEST_ID, http_headers.REPLICA, http_headers.DEVICE, http_headers.PRIORITY,
    http_headers.VERSION))  # fmt: skip
_FORWARDED = (b"content-type", b"content-length", _REQUEST_ID, b"cache-control")
"""Upstream response headers passed to the client."""
_SSE = sse.MEDIA_TYPE.encode()
MAX_HELD_BYTES = 1 << 20
"""The most of an unfinished event held back from the client until its end arrives (a longer
event goes on in pieces, as it comes)."""
MAX_RETRIES = 2
"""Other replicas a request is sent to when one fails before answering anything."""
LEFT_GRACE_S = 0.05
"""How long a direct stream's end is waited for once its client has left (the worker sends
the end right after the answer's last piece, so a client that closed on it had it all)."""
REMOTE_EJECT_S = 5.0
"""Another node's replica that could not be connected to stays out of routing this long."""


class Relay(Response):
    """The response to one request: admits it, sends it to its replica, relays the answer.

    Its ``__call__`` takes a replica slot (at once, or after waiting in the gateway's queue)
    and gives it back in its ``finally``, so the slot is taken and released exactly once
    however the exchange ends. A task watches for the client disconnecting and cancels the
    wait or the relay, which takes the request out of the queue or closes the upstream
    connection (the worker then aborts)."""

    def __init__(
        self,
        state: GatewayState,
        ticket: Ticket,
        path: str,
        body: bytes,
        request_id: str,
        headers: tuple[tuple[bytes, bytes], ...] = (),
        recorder: Recorder | None = None,
    ) -> None:
        self.state, self.ticket = state, ticket
        self.worker_headers, self.recorder = headers, recorder
        """Headers for the worker besides the request id; who reads the answer as it passes
        (the Responses API's kept answers)."""
        self.replica: Replica | None = None
        self.path, self.payload, self.request_id = path, body, request_id
        self.status_code, self.raw_headers, self.background = 200, [], None
        self._ended = False
        self._refusal: KunlunError | None = None
        self.arrived = time.perf_counter()  # telemetry: perf_counter readings
        self.dispatched: float | None = None  # telemetry
        self.first_byte: float | None = None
        """When the first piece of the answer's body went to the client."""
        self.stream_error = False
        """A rollout's request whose streamed answer ended with an error event."""
        self.retries = 0
        self.direct = False
        """The worker wrote the answer's body to the client's connection (telemetry)."""
        self._left: asyncio.Event | None = None
        """Set when the client leaves while a worker writes it a direct stream."""
        self.client: Any = None
        """The client connection's transport where the answer may be a direct stream
        (:mod:`kunlun.serving.handoff`), else None."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        admission = self.state.admission
        if admission is None:
            raise RuntimeError("gateway_router() did not set up admission")
        if self.state.direct_streams and self.ticket.streams and self.recorder is None:
            self.client = client_socket(scope)
        self.state.num_active += 1
        relay = asyncio.current_task()
        watcher = asyncio.ensure_future(self._watch(receive, relay))
        try:
            replica = admission.try_admit(self.ticket)
            try:
                while True:
                    if replica is None:
                        try:
                            replica = await admission.wait(self.ticket)
                        except (QueueFull, ServiceUnavailable) as exc:
                            self._refusal = exc
                            await self._send_error(send, exc)
                            return
                    self.replica = replica
                    if not await self._exchange(send, replica):
                        return
                    # failed before its first byte: once more on another replica
                    admission.release(self.ticket)
                    self.ticket.avoid += (replica.replica_id,)
                    self.retries += 1
                    replica = admission.try_admit(self.ticket)
            finally:
                admission.release(self.ticket)
        except asyncio.CancelledError:
            if not watcher.done() or watcher.cancelled():
                raise  # cancelled from elsewhere
            if relay is not None:
                relay.uncancel()  # the client left: nothing to answer
            self.status_code = CLIENT_GONE  # telemetry
        finally:
            self._ended = True
            watcher.cancel()
            self.state.num_active -= 1
            self._count()

    def _count(self) -> None:
        """Telemetry: a few counter increments, no body parsing."""
        r, metrics = self.replica, self.state.metrics
        version = self.ticket.version
        if (  # the rollout's gates: what the version answered (not a client that left)
            version is not None
            and self.status_code != CLIENT_GONE
            and (r is not None or self.status_code >= 500)
        ):
            now = time.perf_counter()
            ttft = None if self.first_byte is None else (self.first_byte - self.arrived) * 1e3
            error = self.status_code >= 500 or self.stream_error
            self.state.rollout_stats.record(version.rollout_id, version.window, version.role,
                                            error, ttft, (now - self.arrived) * 1e3)  # fmt: skip
        if r is None:  # refused, or its client left, while waiting in the gateway's queue
            if self._refusal is not None:
                metrics.refused(self.ticket.model, True, self._refusal)
            elif self.status_code == CLIENT_GONE:
                metrics.left(self.ticket.model, self.ticket.priority)
            return
        metrics.finished(r.model, r.replica_id, self.ticket.priority, self.status_code,
                         self.arrived, self.dispatched, self.direct)  # fmt: skip

    async def _watch(self, receive: Receive, relay: asyncio.Task[Any] | None) -> None:
        while (await receive())["type"] != "http.disconnect":
            pass
        if self._left is not None:  # a direct stream: its end may be on its way
            self._left.set()
        elif not self._ended and relay is not None:
            relay.cancel()

    async def _exchange(self, send: Send, replica: Replica) -> bool:
        """Send the request to ``replica`` and relay its answer. True when it failed before
        anything was sent to the client and another replica may take it (the caller tries
        again there, at most :data:`MAX_RETRIES` times); the client then has no answer yet."""
        pool = self.state.upstream
        if pool is None:
            raise RuntimeError("GatewayState.start() was not called")
        headers = [(b"content-type", b"application/json"),
                   (_REQUEST_ID, self.request_id.encode()), *self.worker_headers,
                   *replica.key_headers]  # fmt: skip
        payload = self.payload
        if replica.engine != EMBEDDED_ENGINE:  # an external engine: no Kunlun worker checks it
            try:
                payload = external_body(replica.engine, self.path, payload)
            except KunlunError as exc:
                await self._send_error(send, exc)
                return False
        self.dispatched = time.perf_counter()  # telemetry: end of the gateway queue time
        if self.client is not None and replica.handoff is not None and replica.node is None:
            return await self._hand_off(send, replica, headers)
        try:
            upstream = await pool.post(replica.base_url, self.path, headers, payload)
        except UpstreamError as exc:
            error = self._unreachable(replica, exc)
            if isinstance(exc, UpstreamUnreachable | UpstreamBroken) and self._may_retry(replica):
                return True
            await self._send_error(send, error)
            return False
        try:
            await self._relay(upstream, send, replica)
        finally:
            await upstream.close()
        return False

    async def _hand_off(
        self, send: Send, replica: Replica, headers: list[tuple[bytes, bytes]]
    ) -> bool:
        """:meth:`_exchange` as a direct stream: the worker writes the body to the client's
        connection itself (:mod:`kunlun.serving.handoff`)."""
        assert replica.handoff is not None and self.client is not None
        state = self.state
        try:
            link = await DirectLink.open(replica.handoff, self.client, self.path, headers,
                                         self.payload, state.connect_timeout_s,
                                         state.read_timeout_s)  # fmt: skip
        except UpstreamError as exc:
            error = self._unreachable(replica, exc)
            if self._may_retry(replica):
                return True
            await self._send_error(send, error)
            return False
        try:
            try:
                status, head, direct = await link.start(state.first_byte_timeout_s)
            except UpstreamError as exc:  # as the relay's: no head yet, so another may take it
                error = self._unreachable(replica, exc)
                if self._may_retry(replica):
                    return True
                await self._send_error(send, error)
                return False
            streamed = direct and any(k == b"content-type" and v.startswith(_SSE) for k, v in head)
            await send({"type": "http.response.start", "status": status,
                        "headers": self._answer_headers(head, replica)})  # fmt: skip
            self.status_code = status  # telemetry
            if not direct:  # a refusal, or a whole answer: relayed from the link
                try:
                    async for piece in link.pieces():
                        await send({"type": "http.response.body", "body": piece,
                                    "more_body": True})  # fmt: skip
                except UpstreamBroken as exc:
                    self.status_code = self._died(replica, exc).http_status  # telemetry
                self._ended = True
                await send({"type": "http.response.body", "body": b"", "more_body": False})
                return False
            if not await wait_flushed(self.client):
                self.status_code = CLIENT_GONE  # it left before its answer's head had gone
                return False
            link.go()
            self.direct = True  # telemetry
            try:
                end = await self._direct_end(link)
            except UpstreamBroken as exc:
                error = self._died(replica, exc)
                self.status_code = error.http_status  # telemetry
                if link.inside_chunk:  # it left part of a chunk: nothing may follow it
                    shut(self.client)  # the client reads what came, then the connection's end
                elif streamed:  # the worker writes whole events, one chunk each
                    event = sse.error_event(error)
                    await send({"type": "http.response.body", "body": event, "more_body": True})
                self._ended = True
                await send({"type": "http.response.body", "body": b"", "more_body": False})
                if isinstance(exc, UpstreamTimeout) and await wait_flushed(self.client):
                    shut(self.client)  # a silent worker may wake: it must not write after this
                return False
            if end is None:
                self.status_code = CLIENT_GONE  # the client left mid-stream
                return False
            first_byte = end.get("first_byte")
            self.first_byte = first_byte if isinstance(first_byte, float) else None
            self.stream_error = bool(end.get("error_event"))
            self._ended = True
            await send({"type": "http.response.body", "body": b"", "more_body": False})
            return False
        finally:
            link.close()

    async def _direct_end(self, link: DirectLink) -> dict[str, Any] | None:
        """The worker's end of a direct answer, or None when the client left first. A client
        that closes its connection on ``[DONE]`` (the openai SDK does) has its whole answer:
        the end the worker sent right after it is waited for :data:`LEFT_GRACE_S`."""
        left = self._left = asyncio.Event()
        ending = asyncio.ensure_future(link.end())
        leaving = asyncio.ensure_future(left.wait())
        try:
            await asyncio.wait((ending, leaving), return_when=asyncio.FIRST_COMPLETED)
            if not ending.done():
                await asyncio.wait((ending,), timeout=LEFT_GRACE_S)
            if not ending.done():  # the end may have come unread: the timer ran first
                ending.cancel()
                await asyncio.gather(ending, return_exceptions=True)
                end = link.end_if_here()
            elif left.is_set() and ending.exception() is not None:
                return None  # gone first: the worker may have found it gone too, and stopped
            else:
                end = ending.result()
            return None if end is None or end.get("client_gone") else end
        finally:
            self._left = None
            ending.cancel()
            leaving.cancel()

    def _answer_headers(
        self, upstream: list[tuple[bytes, bytes]], replica: Replica
    ) -> list[tuple[bytes, bytes]]:
        """The client's answer's headers: the worker's that pass, and the gateway's own."""
        raw = [(k, v) for k, v in upstream if k in _FORWARDED]
        raw += [(_REPLICA, replica.replica_id.encode()),
                (_DEVICE, replica.device.encode()),
                (_PRIORITY, self.ticket.priority.encode())]  # fmt: skip
        version = self.ticket.version
        if version is not None:
            raw.append((_VERSION, version.header))
        return raw

    def _may_retry(self, failed: Replica) -> bool:
        """Whether another routable replica of the request's model (and version) is left."""
        if self.retries >= MAX_RETRIES or self.state.admission is None:
            return False
        ticket, avoid = self.ticket, (*self.ticket.avoid, failed.replica_id)
        return any(r.routable and r.replica_id not in avoid
                   and (ticket.workload is None or r.workload_id == ticket.workload)
                   and (ticket.pool is None or ticket.pool in r.pools)
                   for r in self.state.admission.replicas.serving(ticket.model))  # fmt: skip

    async def _relay(self, upstream: UpstreamResponse, send: Send, replica: Replica) -> None:
        raw = self._answer_headers(upstream.headers, replica)
        version = self.ticket.version
        self.status_code = upstream.status_code  # telemetry
        await send({"type": "http.response.start", "status": upstream.status_code, "headers": raw})
        last, final, held = b"\n\n", False, b""
        streamed = (upstream.header(b"content-type") or b"").startswith(_SSE)
        try:
            async for piece in upstream.iter_raw():
                if self.first_byte is None:
                    self.first_byte = time.perf_counter()
                final = upstream.complete  # then the end of the body goes with this write
                chunk = held + piece if held else piece
                if streamed and not final:  # an unfinished event waits for its end
                    whole = sse.whole_events(chunk)
                    if whole < len(chunk) and len(chunk) - whole <= MAX_HELD_BYTES:
                        chunk, held = chunk[:whole], chunk[whole:]
                        if not chunk:
                            continue
                    else:
                        held = b""
                if version is not None and streamed and sse.ERROR_EVENT_START in chunk:
                    self.stream_error = True  # an engine error ended the stream
                # A stream's answer is whole once its [DONE] is out, though the end of the
                # chunked body may come in a later read: a client that closes on [DONE] (the
                # openai SDK does) has its answer, and is not one that left first.
                self._ended = final or (streamed and (last[-14:] + chunk[-14:]).endswith(sse.DONE))
                if self.recorder is not None:
                    self.recorder.feed(chunk)
                    if final:  # kept before the client has all of it, so it may go on at once
                        await self._keep(upstream.status_code)
                await send({"type": "http.response.body", "body": chunk, "more_body": not final})
                if final:
                    break
                last = chunk
            if held:  # the body ended inside an event (no blank line after it): it goes on
                if self.recorder is not None:
                    self.recorder.feed(held)
                await send({"type": "http.response.body", "body": held, "more_body": True})
                last = held
            await self._keep(upstream.status_code)
        except UpstreamBroken as exc:
            error = self._died(replica, exc)
            self.status_code = error.http_status  # telemetry
            if streamed:
                separator = b"" if last.endswith(b"\n\n") else b"\n\n"
                event = separator + sse.error_event(error)
                await send({"type": "http.response.body", "body": event, "more_body": True})
        if not final:
            self._ended = True
            await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def _keep(self, status: int) -> None:
        """Hand the whole answer to the recorder, once (the Responses API's kept answers)."""
        recorder, self.recorder = self.recorder, None
        if recorder is not None:
            await recorder.finish(status)

    async def _send_error(self, send: Send, exc: KunlunError) -> None:
        status, body, extra = error_status_and_body(exc)
        payload = sse.dumps(body)
        headers = [(b"content-type", b"application/json"),
                   (b"content-length", str(len(payload)).encode()),
                   (_REQUEST_ID, self.request_id.encode()),
                   (_PRIORITY, self.ticket.priority.encode())]  # fmt: skip
        if self.replica is not None:
            headers += [(_REPLICA, self.replica.replica_id.encode()),
                        (_DEVICE, self.replica.device.encode())]  # fmt: skip
        if self.ticket.version is not None:
            headers.append((_VERSION, self.ticket.version.header))
        headers += [(k.lower().encode(), v.encode()) for k, v in extra.items()]
        self.status_code = status  # telemetry
        await send({"type": "http.response.start", "status": status, "headers": headers})
        self._ended = True
        await send({"type": "http.response.body", "body": payload, "more_body": False})

    def _died(self, replica: Replica, exc: Exception) -> KunlunError:
        where = f"replica {replica.replica_id} on {replica.device}"
        if replica.fault is not None or isinstance(exc, UpstreamTimeout):
            why = replica.fault or str(exc)
            return WorkerUnresponsive(
                f"the engine worker serving this request stopped answering ({where}: {why})",
                hint="retry the request; the platform restarts an unresponsive worker",
            )
        return WorkerDied(
            f"the engine worker serving this request stopped before finishing it "
            f"(replica {replica.replica_id} on {replica.device}: "
            f"{type(exc).__name__}: {exc})",
            hint="retry the request; the platform restarts the worker",
        )

    def _unreachable(self, replica: Replica, exc: Exception) -> KunlunError:
        if replica.node is not None and isinstance(exc, UpstreamUnreachable):
            # another node that cannot be reached: out of routing for a while, not until its
            # lease runs out
            replica.ready = False
            replica.ejected_until = time.monotonic() + REMOTE_EJECT_S
        if isinstance(exc, UpstreamUnreachable) and replica.fault is None:
            return ServiceUnavailable(
                f"the engine worker of replica {replica.replica_id} on "
                f"{replica.device} is not reachable ({type(exc).__name__}: {exc})",
                retry_after_s=self.state.retry_after_s,
            )
        return self._died(replica, exc)
