"""Admission: the gateway holds the backlog and releases it to replicas by weighted fair
queuing across priority classes.

Each replica takes at most ``slots`` requests at once (its workload's ``max_num_seqs``). A
request that finds no free slot waits here, in its model's :class:`Backlog`: one FIFO queue
per priority class, each with its own limit (one more answers 429). When a slot frees, the
backlog picks the next request by start-time fair queuing: every class carries a virtual
finish tag that grows by ``1 / weight`` per admitted request; the backlogged class with the
smallest next tag goes first (ties to the more urgent class), and a class that was idle
rejoins at the current virtual time, so it gets no credit for idleness. With high (3) and low
(1) both backlogged, high is admitted three times as often; the order is deterministic.

A request whose client leaves while it waits is taken out of its queue. The ``max_queue`` of
the replicas still bounds a model's requests in flight and waiting together.

No request waits longer than ``max_queue_wait_s`` (``scheduler_config.yaml``): past it, it
leaves its queue with 429. Every 429 carries a ``Retry-After`` estimated from the model's
:class:`DrainRate`, the requests admitted per second over the last :data:`DRAIN_WINDOW_S`:
``ceil((waiting + 1) / rate)`` seconds, at least 1 and at most :data:`MAX_RETRY_AFTER_S`
(with nothing admitted in the window, ``max_queue_wait_s``).
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from kunlun.limits import PRIORITIES
from kunlun.protocol.openai_errors import QueueFull, ServiceUnavailable
from kunlun.serving.canary_split import Version
from kunlun.serving.replica import Replica, ReplicaSet
from kunlun.serving.routing import Router
from kunlun.serving.scheduler_config import SchedulerConfig

DRAIN_WINDOW_S = 30.0
"""The recent window over which a model's drain rate is measured (seconds)."""
MAX_RETRY_AFTER_S = 3600
"""The largest ``Retry-After`` the gateway sends (seconds)."""


class DrainRate:
    """Requests of one model admitted per second over the last ``window_s`` seconds.

    :meth:`per_second` is the number of admissions in the window divided by the time since
    the oldest of them (at least 1 s), so a queue that stops draining sees its rate decay;
    None when nothing was admitted in the window. :meth:`retry_after` turns it into the
    seconds a refused client should wait for ``ahead`` requests to drain."""

    def __init__(
        self, window_s: float = DRAIN_WINDOW_S, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.window_s = window_s
        self.clock = clock
        self.times: deque[float] = deque()

    def admitted(self) -> None:
        """Count one admission now."""
        now = self.clock()
        self.times.append(now)
        self._trim(now)

    def per_second(self) -> float | None:
        now = self.clock()
        self._trim(now)
        if not self.times:
            return None
        return len(self.times) / max(now - self.times[0], 1.0)

    def retry_after(self, ahead: int, fallback_s: float) -> int:
        """Whole seconds for ``ahead`` requests to be admitted at the measured rate (or
        ``fallback_s`` with no rate), from 1 to :data:`MAX_RETRY_AFTER_S`."""
        rate = self.per_second()
        seconds = fallback_s if rate is None else max(ahead, 1) / rate
        return max(1, min(MAX_RETRY_AFTER_S, math.ceil(seconds)))

    def _trim(self, now: float) -> None:
        while self.times and now - self.times[0] > self.window_s:
            self.times.popleft()


@dataclass(slots=True, eq=False)
class Ticket:
    """One request as admission sees it."""

    model: str
    priority: str
    """Its class: high, normal or low (:func:`~kunlun.serving.routing.resolve_priority`)."""
    pool: str | None
    """Pool it is restricted to (``X-Kunlun-Pool``: a device type, or device type/engine), or
    None for any."""
    tokens: int
    """Estimated tokens it adds to its replica: prompt estimate + ``max_tokens`` x ``n``."""
    workload: str | None = None
    """The workload it must go to (its version of the model during a rollout), or None."""
    avoid: tuple[str, ...] = ()
    """Replicas it must not go to (it failed on them before its first byte)."""
    version: Version | None = None
    """During a rollout of its model: the version it was sent to (and ``workload`` is it)."""
    replica: Replica | None = None
    """The replica it was admitted to (its slot is held until :meth:`Admission.release`)."""
    future: asyncio.Future[Replica] | None = None
    """Set while it waits; resolved with its replica when admitted."""
    streams: bool = False
    """It asks for a streamed answer (``"stream": true``): a worker on this node may write
    it to the client's connection itself (:mod:`kunlun.serving.handoff`)."""


class Backlog:
    """The waiting requests of one model, per class, released by fair queuing."""

    def __init__(self) -> None:
        self.queues: dict[str, deque[Ticket]] = {c: deque() for c in PRIORITIES}
        self.finish: dict[str, float] = dict.fromkeys(PRIORITIES, 0.0)
        """Virtual finish tag of each class's last admitted request."""
        self.virtual_time = 0.0
        """Start tag of the last admitted request."""
        self.num_waiting = 0

    def push(self, ticket: Ticket) -> None:
        queue = self.queues[ticket.priority]
        if not queue:
            self.finish[ticket.priority] = max(self.finish[ticket.priority], self.virtual_time)
        queue.append(ticket)
        self.num_waiting += 1

    def remove(self, ticket: Ticket) -> None:
        """Take a request out of its queue (its client left)."""
        queue = self.queues[ticket.priority]
        if ticket in queue:
            queue.remove(ticket)
            self.num_waiting -= 1

    def order(self, weights: dict[str, float]) -> list[str]:
        """The backlogged classes, the one to serve first first."""
        waiting = [c for c in PRIORITIES if self.queues[c]]
        return sorted(waiting, key=lambda c: self.finish[c] + 1.0 / weights[c])

    def take(self, ticket: Ticket, weights: dict[str, float]) -> None:
        """Admit ``ticket`` (in a queue): advance its class's tag and the virtual time."""
        self.queues[ticket.priority].remove(ticket)
        self.num_waiting -= 1
        start = self.finish[ticket.priority]
        self.finish[ticket.priority] = start + 1.0 / weights[ticket.priority]
        self.virtual_time = max(self.virtual_time, start)


class Admission:
    """Slots, backlogs and replica choice for every model behind the gateway."""

    def __init__(
        self, replicas: ReplicaSet, router: Router, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.replicas = replicas
        self.router = router
        self.clock = clock
        """Time source of the drain rates (seconds)."""
        self.backlogs: dict[str, Backlog] = {}
        self.drain: dict[str, DrainRate] = {}
        """Each model's admissions per second (for ``Retry-After``)."""

    # ---- the request path ----
    def try_admit(self, ticket: Ticket) -> Replica | None:
        """Take a free slot at once if nobody of the model waits; None otherwise (then
        :meth:`wait`, which lets it go first if those waiting are blocked on a full pool)."""
        backlog = self.backlogs.get(ticket.model)
        if backlog is not None and backlog.num_waiting:
            return None
        replicas = self.replicas.serving(ticket.model)
        replica = self.router.choose(
            replicas, ticket.pool, ticket.tokens, ticket.workload, ticket.avoid
        )
        if replica is not None:
            self._hold(replica, ticket)
        return replica

    def enqueue(self, ticket: Ticket) -> Backlog:
        """Put ``ticket`` in its class's queue, or raise :class:`QueueFull`."""
        config = self.router.source.config
        backlog = self.backlogs.setdefault(ticket.model, Backlog())
        limit = getattr(config.queue_limits, ticket.priority)
        queued = len(backlog.queues[ticket.priority])
        if queued >= limit:
            raise QueueFull(
                f"the {ticket.priority}-priority queue of model {ticket.model!r} is full "
                f"({queued} waiting, queue_limits.{ticket.priority} = {limit})",
                retry_after_s=self.retry_after(ticket.model),
            )
        replicas = self.replicas.ready(ticket.model)
        bound = sum(r.max_queue for r in replicas)
        total = sum(r.in_flight for r in replicas) + backlog.num_waiting
        if total >= bound:
            raise QueueFull(
                f"every replica of model {ticket.model!r} has its queue full "
                f"({total} requests in flight or waiting, max_queue {bound} over "
                f"{len(replicas)} replica(s))",
                retry_after_s=self.retry_after(ticket.model),
            )
        backlog.push(ticket)
        return backlog

    async def wait(self, ticket: Ticket) -> Replica:
        """Queue ``ticket`` and wait for a slot, at most ``max_queue_wait_s`` (then
        :class:`QueueFull`); if the waiter is cancelled (its client left) the ticket leaves
        the queue, or gives back the slot it was just given."""
        backlog = self.enqueue(ticket)
        loop = asyncio.get_running_loop()
        ticket.future = loop.create_future()
        self.dispatch(ticket.model)  # it may go at once if those ahead wait for a full pool
        max_wait_s = self.router.source.config.max_queue_wait_s
        expiry = loop.call_later(max_wait_s, self._expire, backlog, ticket, max_wait_s)
        try:
            return await ticket.future
        except asyncio.CancelledError:
            if ticket.replica is not None:
                self.release(ticket)
            else:
                backlog.remove(ticket)
            raise
        finally:
            expiry.cancel()

    def retry_after(self, model: str) -> int:
        """``Retry-After`` for a request of ``model`` refused now: the time for those
        waiting, and it, to be admitted at the model's measured drain rate."""
        backlog = self.backlogs.get(model)
        waiting = backlog.num_waiting if backlog is not None else 0
        fallback = self.router.source.config.max_queue_wait_s
        return self._drain(model).retry_after(waiting + 1, fallback)

    def release(self, ticket: Ticket) -> list[Ticket]:
        """The request of ``ticket`` ended: free its slot and admit whoever waits (returned)."""
        replica, ticket.replica = ticket.replica, None
        if replica is None:
            return []
        replica.in_flight -= 1
        replica.outstanding_tokens -= ticket.tokens
        backlog = self.backlogs.get(ticket.model)
        if backlog is not None and backlog.num_waiting:
            return self.dispatch(ticket.model)
        return []

    # ---- the backlog ----
    def dispatch(self, model: str) -> list[Ticket]:
        """Admit waiting requests of ``model`` while replicas have free slots, in fair
        queuing order (a request whose pool has no free slot lets the next one go first).
        Returns the tickets admitted."""
        backlog = self.backlogs.get(model)
        admitted: list[Ticket] = []
        if backlog is None:
            return admitted
        replicas = self.replicas.serving(model)
        weights = _weights(self.router.source.config)
        while backlog.num_waiting:
            ticket, replica = self._next(backlog, replicas, weights)
            if ticket is None or replica is None:
                break
            backlog.take(ticket, weights)
            self._hold(replica, ticket)
            if ticket.future is not None and not ticket.future.done():
                ticket.future.set_result(replica)
            admitted.append(ticket)
        return admitted

    def dispatch_all(self, retry_after_s: int = 1) -> None:
        """Admit what can go in every backlog, and refuse (503) the waiters that no replica
        will ever take: their model, or their pool, has no replica left (its workload
        stopped). Called periodically, so that a replica becoming ready lets the backlog
        move."""
        pools: dict[str, set[str]] = {}
        workloads: dict[str, set[str]] = {}
        for replica in self.replicas.all():
            pools.setdefault(replica.model, set()).update(replica.pools)
            workloads.setdefault(replica.model, set()).add(replica.workload_id)
        for model, backlog in list(self.backlogs.items()):
            if backlog.num_waiting:
                self._refuse_orphans(model, backlog, pools.get(model, set()),
                                     workloads.get(model, set()), retry_after_s)  # fmt: skip
                self.dispatch(model)

    def num_waiting(self) -> int:
        return sum(b.num_waiting for b in self.backlogs.values())

    # ---- internals ----
    def _next(
        self, backlog: Backlog, replicas: tuple[Replica, ...], weights: dict[str, float]
    ) -> tuple[Ticket | None, Replica | None]:
        for priority in backlog.order(weights):
            for ticket in backlog.queues[priority]:
                replica = self.router.choose(
                    replicas, ticket.pool, ticket.tokens, ticket.workload, ticket.avoid
                )
                if replica is not None:
                    return ticket, replica
                if ticket.pool is None and ticket.workload is None and not ticket.avoid:
                    return None, None  # no free slot anywhere
        return None, None

    def _hold(self, replica: Replica, ticket: Ticket) -> None:
        replica.in_flight += 1
        replica.outstanding_tokens += ticket.tokens
        ticket.replica = replica
        self._drain(ticket.model).admitted()

    def _drain(self, model: str) -> DrainRate:
        drain = self.drain.get(model)
        if drain is None:
            drain = self.drain[model] = DrainRate(clock=self.clock)
        return drain

    def _expire(self, backlog: Backlog, ticket: Ticket, max_wait_s: float) -> None:
        """``ticket`` waited ``max_wait_s``: out of its queue, refused with 429."""
        future = ticket.future
        if future is None or future.done() or ticket.replica is not None:
            return
        backlog.remove(ticket)
        future.set_exception(QueueFull(
            f"the request waited {max_wait_s:g} s in the queue of model {ticket.model!r} "
            f"without a free replica slot (max_queue_wait_s = {max_wait_s:g}; "
            f"{backlog.num_waiting} still waiting)",
            retry_after_s=self.retry_after(ticket.model),
            hint="retry after the Retry-After delay, or raise max_queue_wait_s in "
            "scheduler_config.yaml",
        ))  # fmt: skip

    def _refuse_orphans(
        self,
        model: str,
        backlog: Backlog,
        pools: set[str],
        workloads: set[str],
        retry_after_s: int,
    ) -> None:
        """Refuse (503) the waiters no replica will take: ``pools`` (the pool names of the
        model's replicas, ready or not) is empty, or lacks the pool they asked for, or
        ``workloads`` (those replicas' workloads) lacks the version they were sent to."""
        for queue in backlog.queues.values():
            orphans = [t for t in queue if not pools or (t.pool and t.pool not in pools)
                       or (t.workload and t.workload not in workloads)]  # fmt: skip
            for ticket in orphans:
                backlog.remove(ticket)
                what = f"pool {ticket.pool!r} of model {model!r}" if pools else f"model {model!r}"
                error = ServiceUnavailable(
                    f"{what} is no longer served here (its workload stopped)",
                    retry_after_s=retry_after_s,
                )
                if ticket.future is not None and not ticket.future.done():
                    ticket.future.set_exception(error)


def _weights(config: SchedulerConfig) -> dict[str, float]:
    w = config.priority_weights
    return {"high": w.high, "normal": w.normal, "low": w.low}
