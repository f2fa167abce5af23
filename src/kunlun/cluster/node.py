"""A platform node's cluster loop: the view, the lease, the election, the controller, the
local replicas; and what ``kunlun-cli node`` and ``/metrics`` show of them.

Two threads: one renews the lease every third of its TTL (and registers again after losing
it); the other wakes on every change the watch brings (at least twice a second) and, in
order, campaigns when nobody leads, runs the controller while this node leads, and reconciles
this node's replicas. etcd being unreachable stops neither: what runs keeps serving, the loop
retries, and the first failure is printed once.
"""

from __future__ import annotations

import json
import queue
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from kunlun.cluster.batches import BatchOwners
from kunlun.cluster.controller import HEARTBEAT, Controller
from kunlun.cluster.local import LocalReplicas
from kunlun.cluster.member import (
    DRAIN,
    LEADER,
    NODES,
    ClusterConfig,
    ClusterView,
    Membership,
)
from kunlun.errors import ClusterUnavailable, ConfigError, Location
from kunlun.serving.replica import ReplicaSet
from kunlun.serving.routing import DeviceSamples
from kunlun.state.etcd import EtcdStore
from kunlun.state.etcd_wire import Op
from kunlun.state.store import EventRecord
from kunlun.workload.manager import WorkloadManager

MAX_PENDING_EVENTS = 10_000


class ClusterNode:
    def __init__(
        self,
        config: ClusterConfig,
        store: EtcdStore,
        manager: WorkloadManager,
        replicas: ReplicaSet,
        devices: Callable[[], list[dict[str, Any]]],
        samples: DeviceSamples,
    ) -> None:
        self.config, self.store = config, store
        self.etcd = store.etcd
        self.view = ClusterView(self.etcd, config.prefix)
        self.member = Membership(config, self.etcd, devices)
        self.controller = Controller(self.member, self.view, store, self.record_event)
        self.local = LocalReplicas(self.member, self.view, manager, replicas, samples)
        self.batches: BatchOwners | None = None
        """Which node runs each Batch API job (set by the daemon)."""
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._events: queue.Queue[EventRecord] = queue.Queue(maxsize=MAX_PENDING_EVENTS)
        self.events_dropped = 0

    def start(self) -> None:
        """Join: read the cluster, register under a new lease, start both threads."""
        self.view.start()
        self.member.register()
        for target, name in ((self._keepalive, "kunlun-lease"), (self._loop, "kunlun-cluster"),
                             (self._write_events, "kunlun-events")):  # fmt: skip
            thread = threading.Thread(target=target, name=name, daemon=True)
            thread.start()
            self._threads.append(thread)

    def stop(self) -> None:
        self._stop.set()
        self.view.changed.set()
        for thread in self._threads:
            thread.join(timeout=10)
        self.member.leave()
        self.view.stop()

    @property
    def name(self) -> str:
        return self.config.node_name

    def wake(self) -> None:
        self.view.changed.set()

    def replica_failed(self, workload_id: str, message: str) -> None:
        self.local.replica_failed(workload_id, message)

    def record_event(self, event: EventRecord) -> None:
        """Queue a workload event for the store (callers never wait on etcd)."""
        try:
            self._events.put_nowait(event)
        except queue.Full:
            self.events_dropped += 1
            if self.events_dropped == 1:
                print(f"cluster: over {MAX_PENDING_EVENTS} workload events wait for etcd; "
                      "newer ones are dropped until it answers", flush=True)  # fmt: skip

    def _write_events(self) -> None:
        """Write queued events in order; while etcd is away, the event waits and is retried."""
        pending: EventRecord | None = None
        while not self._stop.is_set() or pending is not None or not self._events.empty():
            if pending is None:
                try:
                    pending = self._events.get(timeout=0.5)
                except queue.Empty:
                    continue
            try:
                self.store.add_event(pending)
                pending = None
            except ClusterUnavailable as exc:
                self.member._unavailable(exc)
                if self._stop.wait(1.0):
                    return
            except Exception as exc:  # noqa: BLE001 - one bad event must not stop the writer
                print(f"cluster: workload event not written ({exc!r}): {pending}", flush=True)
                pending = None

    def _keepalive(self) -> None:
        """Renew every third of the TTL; after a failed renewal, try again within a second
        (so one slow answer from etcd does not cost the lease)."""
        every = self.config.lease_ttl_s / 3
        while not self._stop.wait(every):
            ok = self.member.keepalive()
            if ok and self.member.rejoined.is_set():
                self.wake()
            every = self.config.lease_ttl_s / 3 if ok else min(1.0, self.config.lease_ttl_s / 6)

    def _loop(self) -> None:
        while not self._stop.is_set():
            self.view.changed.wait(0.5)
            self.view.changed.clear()
            if self._stop.is_set():
                return
            try:
                if not self.member.leader and self.view.kv(LEADER) is None:
                    self.member.campaign()
                if self.member.leader:
                    self.controller.tick()
                if self.member.leader and self.batches is not None:
                    ops, said = self.batches.assign()
                    if ops and self.member.fenced(ops):  # said only once it is so
                        for line in said:
                            print(line, flush=True)
                self.local.reconcile()
                if self.batches is not None:
                    self.batches.reconcile()
            except ClusterUnavailable as exc:
                self.member._unavailable(exc)
            except Exception:  # noqa: BLE001 - the loop must outlive one bad pass
                print("cluster loop: " + traceback.format_exc(), flush=True)
                time.sleep(1.0)

    # ---- what the API shows ----
    def leader_name(self) -> str | None:
        kv = self.view.kv(LEADER)
        return None if kv is None else str(json.loads(kv.value).get("name"))

    def status(self) -> dict[str, Any]:
        member = self.member
        kv = self.view.kv(HEARTBEAT)
        beat = None if kv is None else json.loads(kv.value)
        return {
            "node": self.config.node_name,
            "leader": self.leader_name(),
            "is_leader": member.leader,
            "term": member.term,
            "fenced_writes": member.fenced_writes,
            "elections_won": member.elections_won,
            "lease_losses": member.lease_losses,
            "lease_ttl_s": self.config.lease_ttl_s,
            "etcd": self.etcd.endpoints,
            "etcd_unavailable_since": member.unavailable_since,
            "etcd_error": member.last_error,
            "controller": beat,
        }

    def nodes(self) -> list[dict[str, Any]]:
        leader = self.leader_name()
        draining = self.view.items(DRAIN)
        replicas: dict[str, list[dict[str, Any]]] = {}
        for key, status in self.view.replica_statuses().items():
            node, rid = key.split("/", 1)
            replicas.setdefault(node, []).append({"replica_id": rid, **status.model_dump(
                include={"workload_id", "model", "device", "ready", "failed"})})  # fmt: skip
        out = []
        for name, info in self.view.items(NODES).items():
            state = "Draining" if name in draining else "Ready"
            out.append({
                "name": name, "state": state, "leader": name == leader,
                "api_url": info.get("api_url"), "peer_url": info.get("peer_url"),
                "devices": list(info.get("devices") or []),  # as its inventory says them
                "replicas": replicas.get(name, []), "started": info.get("started"),
            })  # fmt: skip
        for name in draining:
            if name not in {n["name"] for n in out}:
                out.append({"name": name, "state": "Down (draining)", "leader": False,
                            "devices": [], "replicas": replicas.get(name, [])})  # fmt: skip
        return out

    def drain(self, name: str, on: bool = True) -> dict[str, Any]:
        known = set(self.view.items(NODES)) | set(self.view.items(DRAIN))
        if name not in known:
            raise ConfigError(
                f"no node {name!r} in the cluster; nodes: {', '.join(sorted(known)) or 'none'}",
                location=Location("NODE"),
            )
        key = self.member.key(DRAIN + name)
        self.etcd.txn(
            [], [Op.put(key, json.dumps({"since": time.time()})) if on else Op.delete(key)]
        )
        self.wake()
        return {"node": name, "draining": on}

    def families(self) -> Iterator[Metric]:
        """``/metrics``: leadership, fencing, lease losses, etcd reachability, nodes."""
        member, node = self.member, [self.config.node_name]
        rows = (
            (GaugeMetricFamily, "kunlun_cluster_leader", "1 while this node leads the cluster.",
             1.0 if member.leader else 0.0),
            (CounterMetricFamily, "kunlun_cluster_fenced_writes",
             "Controller writes refused because this node no longer held the leader key.",
             float(member.fenced_writes)),
            (CounterMetricFamily, "kunlun_cluster_lease_losses",
             "Times this node's lease expired (it registered again).", float(member.lease_losses)),
            (GaugeMetricFamily, "kunlun_cluster_etcd_available",
             "1 when the cluster's etcd answered this node's last call.",
             0.0 if member.unavailable_since else 1.0),
            (GaugeMetricFamily, "kunlun_cluster_nodes", "Nodes with a live lease, as this node "
             "sees them.", float(len(self.view.items(NODES)))),
        )  # fmt: skip
        for kind, name, text, value in rows:
            family = kind(name, text, labels=["node"])
            family.add_metric(node, value)
            yield family
