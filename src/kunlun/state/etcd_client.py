"""A small etcd v3 client over etcd's JSON gateway (gRPC-gateway, etcd 3.4), on httpx.

Unary calls are ``POST`` of JSON to ``/v3/kv/range``, ``/v3/kv/put``, ``/v3/kv/deleterange``,
``/v3/kv/txn``, ``/v3/lease/grant``, ``/v3/lease/keepalive`` and ``/v3/lease/revoke``; a watch
is a ``POST`` to ``/v3/watch`` whose answer is a stream of JSON objects, one a line. Keys and
values travel base64-encoded, int64 fields as strings, and fields at their default value
(``0``, ``false``, an empty list, a ``PUT`` event's type) are left out of answers; those
forms are :mod:`kunlun.state.etcd_wire`'s.

**Failover.** A call goes to the endpoint that last answered and moves on to the next one
when an endpoint cannot be reached, does not answer within ``timeout_s`` (each endpoint
gets that long), answers 5xx or says it has no leader. Every request carries the gRPC
metadata ``hasleader`` (header ``Grpc-Metadata-Hasleader``), so a member cut off from the
quorum says ``etcdserver: no leader`` at once instead of waiting for etcd's own timeout
(7 s with the test settings). An election (a member lost, ``leader changed`` or ``no
leader`` while another member still answers) usually ends within a second or two: while one
is the only reason a call failed (the others refused the connection, or held the request
past ``timeout_s`` waiting for the election themselves), the call is tried again for up to ``election_wait_s``
(default 3 s) before it gives up. An election still unfinished after that is taken for a lost
quorum: later calls try each endpoint once and say so at once, until one succeeds again. When every endpoint failed the call raises
:class:`~kunlun.errors.ClusterUnavailable` naming each cause and endpoint; when every one
refused the TLS handshake it raises :class:`~kunlun.errors.ConfigError` saying whose
certificate was refused. A write whose endpoint timed out may have been applied there and is
sent again to the next endpoint: a put or delete is then applied twice (harmlessly), a
transaction's compare may fail against its own first application. Any other error answer
(a bad request, a lease that does not exist) raises :class:`~kunlun.errors.KunlunError`.

**Watch.** :meth:`Etcd.watch` runs a daemon thread that streams a prefix's events from a
revision on, reconnects (to the next endpoint) from the revision after the last one it
delivered, and reports a compaction as ``on_events([], -compact_revision)``.
"""

from __future__ import annotations

import logging
import ssl
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import httpx

from kunlun.errors import ClusterUnavailable, ConfigError, KunlunError
from kunlun.state.certs import MemberTLS
from kunlun.state.etcd_wire import (
    KV,
    Compare,
    Op,
    TxnResult,
    WatchEvent,
    b64,
    error_of,
    key_span,
    op_result,
    revision_of,
)

if TYPE_CHECKING:
    from kunlun.state.etcd_watch import Watch

log = logging.getLogger(__name__)

_HEADERS = {"Grpc-Metadata-Hasleader": "true"}
#: gRPC codes that mean "try another member": DeadlineExceeded, ResourceExhausted, Unavailable.
_RETRY_CODES = frozenset({4, 8, 14})
#: Answers that mean a leader election is under way (or quorum is gone, which looks the same).
_ELECTION = ("leader changed", "no leader")
_ELECTION_POLL_S = 0.2
_NOT_FOUND = 5
_PAGE = 1000


@dataclass(frozen=True)
class _Failure:
    """Why one endpoint did not answer."""

    endpoint: str
    cause: str
    tls: bool = False
    election: bool = False
    #: No answer in time: a member waiting on an election may hold a request that long.
    timed_out: bool = False


class LeaseNotFound(KunlunError):
    """A write under a lease that has expired (its owner was paused or cut off too long)."""

    code = "cluster.lease_expired"


class Etcd:
    """A client of one etcd cluster; thread-safe. ``endpoints``: client URLs such as
    ``https://10.0.0.1:2379`` (``https`` exactly when ``tls`` is given)."""

    def __init__(
        self,
        endpoints: list[str],
        tls: MemberTLS | None = None,
        timeout_s: float = 3.0,
        election_wait_s: float = 3.0,
    ) -> None:
        if not endpoints:
            raise ConfigError("no etcd endpoint given")
        self.endpoints = [_checked_endpoint(e, tls) for e in endpoints]
        self.timeout_s = timeout_s
        self.election_wait_s = election_wait_s
        # Set when a wait for an election ran out (quorum lost); cleared by the next answer.
        self._no_quorum = False
        self._tls = tls
        verify: ssl.SSLContext | bool = True
        if tls is not None:
            try:
                verify = tls.client_context()
            except (OSError, ssl.SSLError) as exc:
                raise ConfigError(
                    f"cannot load the etcd client certificate {tls.cert} (key {tls.key}, "
                    f"CA {tls.ca}): {exc}"
                ) from None
        self._client = httpx.Client(
            verify=verify, timeout=timeout_s, trust_env=False, headers=_HEADERS
        )
        self._preferred = 0
        self._lock = threading.Lock()
        self._watches: set[Watch] = set()

    # keys
    def get(self, key: str) -> KV | None:
        kvs = self._call("/v3/kv/range", {"key": b64(key)}).get("kvs", [])
        return KV.of(kvs[0]) if kvs else None

    def range(self, prefix: str) -> list[KV]:
        """Every key starting with ``prefix``, sorted by key (read in pages, all at the
        revision of the first)."""
        kvs: list[KV] = []
        span, revision = key_span(prefix, True), 0
        while True:
            body: dict[str, Any] = {**span, "limit": str(_PAGE)}
            if revision:
                body["revision"] = str(revision)
            data = self._call("/v3/kv/range", body)
            revision = revision or revision_of(data)
            page = [KV.of(kv) for kv in data.get("kvs", [])]
            kvs += page
            if not data.get("more") or not page:
                return kvs
            span = {**span, "key": b64(page[-1].key + "\0")}

    def put(self, key: str, value: bytes | str, lease: int = 0) -> int:
        """Store ``value`` at ``key``; returns the store's revision after the write."""
        return revision_of(
            self._call("/v3/kv/put", Op.put(key, value, lease).to_json()["request_put"])
        )

    def delete(self, key: str, prefix: bool = False) -> int:
        """Delete ``key`` (every key under it with ``prefix``); returns how many were."""
        return int(self._call("/v3/kv/deleterange", key_span(key, prefix)).get("deleted", 0))

    def txn(
        self, compare: list[Compare], success: list[Op], failure: Sequence[Op] = ()
    ) -> TxnResult:
        """If every ``compare`` holds, run ``success``, else ``failure``; atomically."""
        data = self._call(
            "/v3/kv/txn",
            {
                "compare": [c.to_json() for c in compare],
                "success": [op.to_json() for op in success],
                "failure": [op.to_json() for op in failure],
            },
        )
        responses = [op_result(r) for r in data.get("responses", [])]
        return TxnResult(bool(data.get("succeeded", False)), revision_of(data), responses)

    def revision(self) -> int:
        """The store's current revision (a count-only read of one absent key)."""
        return revision_of(self._call("/v3/kv/range", {"key": b64("\0"), "count_only": True}))

    # leases
    def lease_grant(self, ttl_s: int) -> int:
        """A new lease of ``ttl_s`` seconds; returns its id."""
        return int(self._call("/v3/lease/grant", {"TTL": str(ttl_s)})["ID"])

    def lease_keepalive(self, lease_id: int) -> int:
        """Renew a lease once; returns its TTL, 0 when it is gone (expired or revoked)."""
        data = self._call("/v3/lease/keepalive", {"ID": str(lease_id)})
        return max(0, int(data.get("result", data).get("TTL", 0)))

    def lease_revoke(self, lease_id: int) -> None:
        """Revoke a lease, deleting its keys; a lease that is already gone is fine."""
        self._call("/v3/lease/revoke", {"ID": str(lease_id)}, ok_codes=frozenset({_NOT_FOUND}))

    # watch
    def watch(
        self,
        prefix: str,
        start_revision: int,
        on_events: Callable[[list[WatchEvent], int], None],
        stop: threading.Event,
    ) -> threading.Thread:
        """Stream the events under ``prefix`` from ``start_revision`` (inclusive) in a
        daemon thread, until ``stop`` is set (the stream is then closed at once).

        ``on_events(events, revision)`` is called for every batch, in revision order, with
        the store's revision when the batch was sent; an empty batch is a progress report
        (every event up to ``revision`` was delivered). A broken stream or a dead member is
        left for the next endpoint, resuming after the last delivered event. When the
        revisions to resume from were compacted away, ``on_events([], -compact_revision)``
        says events were lost: re-read what the caller keeps; the watch resumes at
        ``compact_revision``, the oldest revision left. An exception from ``on_events`` is
        logged and the batch counts as delivered.
        """
        from kunlun.state.etcd_watch import Watch

        watch = Watch(self, prefix, start_revision, on_events, stop)
        thread = threading.Thread(target=watch.run, name=f"etcd-watch {prefix}", daemon=True)
        thread.start()
        return thread

    def close(self) -> None:
        """Close the connections and end every watch of this client."""
        with self._lock:
            watches = list(self._watches)
        for watch in watches:
            watch.shut()
        self._client.close()

    # plumbing
    def _call(
        self, path: str, body: dict[str, Any], ok_codes: frozenset[int] = frozenset()
    ) -> dict[str, Any]:
        """POST ``body`` to the first endpoint that answers (from the last that did); again
        while an election is the only reason none did, up to ``election_wait_s``."""
        deadline = time.monotonic() + self.election_wait_s
        while True:
            answer = self._round(path, body, ok_codes)
            if isinstance(answer, dict):
                self._no_quorum = False
                return answer
            electing = any(f.election for f in answer) and all(
                f.election or f.timed_out or f.cause == "connection refused" for f in answer
            )
            if not electing or self._no_quorum:
                raise _unavailable(answer)
            if time.monotonic() + _ELECTION_POLL_S > deadline:
                self._no_quorum = True
                raise _unavailable(answer)
            time.sleep(_ELECTION_POLL_S)

    def _round(
        self, path: str, body: dict[str, Any], ok_codes: frozenset[int]
    ) -> dict[str, Any] | list[_Failure]:
        """One try of every endpoint: the answer, or why each failed."""
        failures: list[_Failure] = []
        first = self._preferred
        for step in range(len(self.endpoints)):
            index = (first + step) % len(self.endpoints)
            endpoint = self.endpoints[index]
            try:
                response = self._client.post(endpoint + path, json=body)
                data = response.json()
            except httpx.TransportError as exc:
                failures.append(_transport_failure(endpoint, exc, self._tls, self.timeout_s))
                continue
            except ValueError:
                failures.append(_Failure(endpoint, f"HTTP {response.status_code}, not JSON"))
                continue
            error = error_of(data)
            if error is None and response.status_code < 400:
                self._preferred = index
                return dict(data)
            code, message = error or (0, f"HTTP {response.status_code}")
            if code in ok_codes:
                self._preferred = index
                return {}
            if response.status_code >= 500 or code in _RETRY_CODES:
                election = any(text in message for text in _ELECTION)
                failures.append(_Failure(endpoint, _etcd_cause(message), election=election))
                continue
            if "lease not found" in message:
                raise LeaseNotFound(f"etcd at {endpoint}: {message}")
            raise KunlunError(f"etcd at {endpoint} refused {path}: {message} (gRPC code {code})")
        return failures

    def _register(self, watch: Watch, active: bool) -> None:
        with self._lock:
            if active:
                self._watches.add(watch)
            else:
                self._watches.discard(watch)


def _checked_endpoint(endpoint: str, tls: MemberTLS | None) -> str:
    url = endpoint.rstrip("/")
    scheme = url.split("://", 1)[0] if "://" in url else ""
    if scheme not in ("http", "https"):
        raise ConfigError(f"etcd endpoint {endpoint!r} is not an http:// or https:// URL")
    if scheme == "http" and tls is not None:
        raise ConfigError(
            f"etcd endpoint {endpoint} is plain http:// but cluster certificates are given",
            hint="use https:// for a cluster whose etcd runs with TLS",
        )
    if scheme == "https" and tls is None:
        raise ConfigError(
            f"etcd endpoint {endpoint} is https:// but no cluster certificates are given",
            hint="give the cluster certificates (ca.crt and this node's pair)",
        )
    return url


def _transport_failure(
    endpoint: str, exc: httpx.TransportError, tls: MemberTLS | None, timeout_s: float
) -> _Failure:
    cause: BaseException | None = exc
    while cause is not None:
        if isinstance(cause, ssl.SSLCertVerificationError):
            ca = tls.ca if tls else "the system's CAs"
            text = f"the member's certificate was refused: not signed by the CA in {ca}"
            return _Failure(endpoint, f"{text} ({cause.verify_message})", tls=True)
        if isinstance(cause, ssl.SSLError):
            reason = cause.reason or str(cause)
            if tls and ("CERTIFICATE" in reason or "UNKNOWN_CA" in reason):
                text = f"the member refused this client's certificate {tls.cert}"
                return _Failure(endpoint, f"{text} ({reason})", tls=True)
            return _Failure(endpoint, f"the TLS handshake failed ({reason})", tls=True)
        if isinstance(cause, ConnectionRefusedError):
            return _Failure(endpoint, "connection refused")
        cause = cause.__cause__ or cause.__context__
    if isinstance(exc, httpx.TimeoutException):
        return _Failure(endpoint, f"no answer within {timeout_s:g} s", timed_out=True)
    return _Failure(endpoint, f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__)


def _etcd_cause(message: str) -> str:
    if "no leader" in message or "timed out" in message:
        return f"no quorum ({message})"
    return message


def _unavailable(failures: list[_Failure]) -> KunlunError:
    by_cause: dict[str, list[str]] = {}
    for failure in failures:
        by_cause.setdefault(failure.cause, []).append(failure.endpoint)
    summary = "; ".join(f"{cause} at {', '.join(ends)}" for cause, ends in by_cause.items())
    if failures and all(f.tls for f in failures):
        return ConfigError(
            f"the TLS handshake with the cluster state store (etcd) failed: {summary}",
            hint="give the cluster's ca.crt and a certificate signed by that CA; "
            "`kunlun-cli cluster certs` makes them",
        )
    return ClusterUnavailable(
        f"the cluster state store (etcd) is unavailable: {summary}",
        hint="check that a majority of the etcd members are running and reachable",
    )
