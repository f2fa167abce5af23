"""Replicas as the gateway sees them, and the set the node agent keeps up to date.

A replica is one engine worker process serving one workload's model on its devices. The
node agent (in the daemon) starts workers and registers them here; the gateway only reads:
it asks for the ready replicas of a model and sends requests to their ``base_url``.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

from kunlun.engine.launch import DEFAULT_MAX_NUM_SEQS, EMBEDDED_ENGINE
from kunlun.headers import WORKER_KEY, raw
from kunlun.serving.pools import names_of


@dataclass
class Replica:
    """One running engine worker."""

    replica_id: str
    workload_id: str
    model: str
    """The served model name clients use (the workload's alias)."""
    device: str
    """The device it runs on, e.g. ``cpu:0``."""
    base_url: str
    """The worker's own OpenAI-compatible endpoint, e.g. ``http://127.0.0.1:41234``."""
    max_queue: int = 64
    """Requests in flight or waiting at this replica before the gateway answers 429."""
    priority: str = "normal"
    """The workload's priority class: a request's class unless its key or header says."""
    max_num_seqs: int = DEFAULT_MAX_NUM_SEQS
    """Sequences the engine decodes together (the workload's ``max_num_seqs``): the gateway
    sends at most this many requests at once and holds the rest in its own queue."""
    max_model_len: int | None = None
    """The context window its engine was planned with (None: not known, another engine)."""
    created: int = 0
    """When its workload was created (Unix seconds): ``created`` of ``GET /v1/models``."""
    engine: str = EMBEDDED_ENGINE
    """The engine serving it: Kunlun's own worker, or an external server (``llama.cpp``,
    ``vllm``, ``sglang``) whose requests the gateway checks against what it supports."""
    stats_path: str = "/stats"
    """What liveness and health checks read besides a probe: the worker's engine counters;
    an external engine's health path (its answer, liveness only)."""
    task: str = "generate"
    """What its model is served for: ``generate`` or ``embed`` (``/v1/embeddings`` only)."""
    ready: bool = False
    in_flight: int = 0
    """Maintained by the gateway: requests sent and not yet finished."""
    outstanding_tokens: int = 0
    """Maintained by the gateway: estimated tokens (prompt + ``max_tokens``) in flight."""
    pid: int | None = None
    worker_key: str | None = field(default=None, repr=False)
    """The key its worker asks of every request (:attr:`key_headers`), new at each start;
    None: nothing is asked (an external server that takes no key, another node's replica)."""
    handoff: str | None = None
    """The worker's direct-stream socket (its abstract name; :mod:`kunlun.serving.handoff`),
    None for an external engine or another node's replica."""
    node: str | None = None
    """In a cluster, the other node this replica runs on (None: this node's own worker);
    ``base_url`` is then that node's peer port."""
    ejected_until: float = 0.0
    """Another node's replica that could not be reached is not routed to before this
    (``time.monotonic()``), whatever its node last reported."""
    ejected: str | None = None
    """Why the health checker took this replica out of routing (its probes failed or its
    engine stalled; :mod:`kunlun.node.health`); None once a probe passes again. Unlike
    ``fault``, the worker keeps running."""
    fault: str | None = None
    """Why the node agent took this replica out of routing and killed its worker (it was
    unresponsive or stalled); cleared when a new worker is ready. The gateway answers its
    cut-off requests with this reason (504)."""

    @property
    def key_headers(self) -> list[tuple[bytes, bytes]]:
        """The header its worker asks for (:attr:`worker_key`: Kunlun's worker its own
        header, an external server ``Authorization: Bearer``), as raw headers; none when
        nothing is asked."""
        if self.worker_key is None:
            return []
        if self.engine == EMBEDDED_ENGINE:
            return [(raw(WORKER_KEY), self.worker_key.encode())]
        return [(b"authorization", b"Bearer " + self.worker_key.encode())]

    @property
    def routable(self) -> bool:
        """Ready and not ejected: the gateway may send it requests."""
        return self.ready and self.ejected is None

    @property
    def slots(self) -> int:
        """Requests the gateway sends at once: ``max_num_seqs``, or ``max_queue`` if smaller."""
        return min(self.max_num_seqs, self.max_queue)

    @cached_property
    def device_type(self) -> str:
        """The pool of the device (``cpu`` for ``cpu:0`` and for ``node-b/cpu:0``)."""
        return self.device.rpartition("/")[2].partition(":")[0]

    @cached_property
    def pools(self) -> frozenset[str]:
        """The ``X-Kunlun-Pool`` values that reach it: ``cpu`` and ``cpu/<engine>``
        (:mod:`kunlun.serving.pools`)."""
        return names_of(self.device_type, self.engine)


@dataclass
class ReplicaSet:
    """Thread-safe registry of replicas, written by the node agent, read by the gateway."""

    _replicas: dict[str, Replica] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _by_model: dict[str, tuple[Replica, ...]] = field(default_factory=dict)

    def upsert(self, replica: Replica) -> None:
        with self._lock:
            self._replicas[replica.replica_id] = replica
            self._index()

    def remove(self, replica_id: str) -> None:
        with self._lock:
            self._replicas.pop(replica_id, None)
            self._index()

    def _index(self) -> None:
        by_model: dict[str, list[Replica]] = {}
        for r in self._replicas.values():
            by_model.setdefault(r.model, []).append(r)
        self._by_model = {model: tuple(rs) for model, rs in by_model.items()}

    def serving(self, model: str) -> tuple[Replica, ...]:
        """Every replica of ``model``, ready or not: a snapshot the gateway reads for each
        request (no copy, no lock; ``upsert`` and ``remove`` replace it)."""
        return self._by_model.get(model, ())

    def get(self, replica_id: str) -> Replica | None:
        with self._lock:
            return self._replicas.get(replica_id)

    def all(self) -> list[Replica]:
        with self._lock:
            return list(self._replicas.values())

    def ready(self, model: str) -> list[Replica]:
        """Ready replicas serving ``model``."""
        with self._lock:
            return [r for r in self._replicas.values() if r.model == model and r.routable]

    def models(self, task: str | None = None) -> list[str]:
        """Every model name with at least one replica (ready or starting); with ``task``,
        those served for it (``generate``, ``embed``)."""
        with self._lock:
            return sorted({r.model for r in self._replicas.values()
                           if task is None or r.task == task})  # fmt: skip

    def model_cards(self) -> list[dict[str, Any]]:
        """``GET /v1/models``'s entries: per model, OpenAI's fields plus ``max_model_len``
        (the smallest of its replicas', null when none says) and ``created`` (its oldest
        workload's creation)."""
        with self._lock:
            replicas = list(self._replicas.values())
        cards = []
        for model in sorted({r.model for r in replicas}):
            mine = [r for r in replicas if r.model == model]
            lengths = [r.max_model_len for r in mine if r.max_model_len]
            created = [r.created for r in mine if r.created]
            cards.append({"id": model, "object": "model", "created": min(created, default=0),
                          "owned_by": "kunlun", "max_model_len": min(lengths, default=None),
                          "task": mine[0].task})  # fmt: skip
        return cards

    def any_ready(self) -> bool:
        """Whether a replica can take requests now: ready and not out of routing (a stopped
        worker is ejected by its health checks seconds before liveness restarts it)."""
        with self._lock:
            return any(r.routable for r in self._replicas.values())
