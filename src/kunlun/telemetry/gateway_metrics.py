"""The gateway's request metrics: counted on the hot path, so kept to a few increments.

The gateway calls :meth:`GatewayMetrics.refused` when it answers a request itself (unknown
model, nothing ready, queues full, draining, bad body), :meth:`GatewayMetrics.left` when a
request's client disconnects while it waits in the gateway's queue (status 499), and
:meth:`GatewayMetrics.finished` once the exchange of an admitted request with its replica is
over, whatever the ending (499 too when the client left first).
Neither looks at the response body: the relay stays byte for byte. Each replica's series
are looked up once and cached, so a request costs a dict lookup, two histogram
observations and two counter increments (a few microseconds).

Label values come from the platform (served model names, replica ids, priorities), never
from the client: a request for a model nobody serves is counted under ``model="-"``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Histogram

from kunlun.errors import KunlunError
from kunlun.limits import CLIENT_GONE

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 30, 60, 120, 300)
"""Seconds; end-to-end latency of a request (prefill plus every output token)."""
QUEUE_BUCKETS = (0.0001, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1,
                 2.5, 5, 10, 30, 60)  # fmt: skip
"""Seconds; time between a request's arrival and its dispatch to a replica."""
NONE = "-"
"""Label value where a request has no replica, or names a model nobody serves."""
REPLICA_LABELS = ("model", "replica", "priority")


@dataclass
class _ReplicaSeries:
    """One replica's metric children, resolved once."""

    e2e: Histogram
    queue: Histogram
    routed: Counter
    direct: Counter
    by_status: dict[int, Counter]


class GatewayMetrics:
    """Request counters and latency histograms of the gateway, in their own registry."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.requests = Counter(
            "kunlun_requests",
            "Requests answered by the gateway, by HTTP status (499: the client left first; "
            "502: the worker died).",
            [*REPLICA_LABELS, "status"],
            registry=self.registry,
        )
        self.e2e = Histogram(
            "kunlun_e2e_request_latency_seconds",
            "Time from a request's arrival at the gateway to the last byte of its answer.",
            REPLICA_LABELS,
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.queue = Histogram(
            "kunlun_gateway_queue_time_seconds",
            "Time from a request's arrival at the gateway to its dispatch to a replica "
            "(admission and any wait for room).",
            REPLICA_LABELS,
            buckets=QUEUE_BUCKETS,
            registry=self.registry,
        )
        self.decisions = Counter(
            "kunlun_scheduler_decisions",
            "The gateway's admission decisions: routed to a replica, or refused and why.",
            [*REPLICA_LABELS, "decision"],
            registry=self.registry,
        )
        self.direct = Counter(
            "kunlun_direct_streams",
            "Streamed answers the replica's worker wrote to the client's connection itself "
            "(the others went through the gateway's relay).",
            REPLICA_LABELS,
            registry=self.registry,
        )
        self._series: dict[tuple[str, str, str], _ReplicaSeries] = {}

    def finished(
        self,
        model: str,
        replica_id: str,
        priority: str,
        status: int,
        arrived: float,
        dispatched: float | None,
        direct: bool = False,
    ) -> None:
        """An admitted request ended with ``status``; times are ``time.perf_counter()``
        readings (``dispatched`` is None when it never reached the replica); ``direct``: its
        worker wrote the answer to the client's connection."""
        now = time.perf_counter()
        key = (model, replica_id, priority)
        series = self._series.get(key) or self._resolve(key)
        counter = series.by_status.get(status)
        if counter is None:
            counter = series.by_status[status] = self.requests.labels(*key, str(status))
        counter.inc()
        series.routed.inc()
        if direct:
            series.direct.inc()
        series.e2e.observe(now - arrived)
        if dispatched is not None:
            series.queue.observe(dispatched - arrived)

    def refused(self, model: str | None, served: bool, exc: KunlunError) -> None:
        """The gateway answered ``exc`` itself; ``served``: whether ``model`` is served here."""
        label = model if model is not None and served else NONE
        self.requests.labels(label, NONE, NONE, str(exc.http_status)).inc()
        self.decisions.labels(label, NONE, NONE, _decision(exc)).inc()

    def left(self, model: str, priority: str) -> None:
        """The client of a request waiting in the gateway's queue for ``model`` (a served
        one) disconnected: counted with status 499 and no replica."""
        self.requests.labels(model, NONE, priority, str(CLIENT_GONE)).inc()

    def _resolve(self, key: tuple[str, str, str]) -> _ReplicaSeries:
        series = _ReplicaSeries(
            e2e=self.e2e.labels(*key),
            queue=self.queue.labels(*key),
            routed=self.decisions.labels(*key, "routed"),
            direct=self.direct.labels(*key),
            by_status={},
        )
        self._series[key] = series
        return series


def _decision(exc: KunlunError) -> str:
    """The decision label of a refusal: the error code's last part (``queue_full``,
    ``unavailable``, ``model_not_found``, ...)."""
    return exc.code.rsplit(".", 1)[-1]
