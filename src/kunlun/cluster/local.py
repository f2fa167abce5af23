"""A node's side of the cluster: start the replicas assigned to it, report them, and route to
every other node's.

- Each replica index the leader assigned to this node is planned and launched here with the
  node's own devices (the same placement and plan cache as on one machine, one replica).
- A local replica no longer assigned here (the leader moved it: drain, or this node was
  paused past its lease) keeps serving until its new node reports it ready, at most
  :data:`HANDOVER_S`: a replica is never gone before its successor serves. It then leaves
  routing on every node and stops once the requests it has are answered (at most
  :data:`DRAIN_S`): a move cuts no stream.
- Every local replica is reported under ``cluster/replicas/<node>/<replica>`` with the node's
  lease (device, ready, slots, memory reserved, or why it failed here), and whether its
  health checks took it out of routing (``ejected``, :mod:`kunlun.node.health`): every
  node's gateway then leaves it out too.
- Every other node's reported replica is put in this node's :class:`ReplicaSet` with the
  other node's peer URL, so the gateway routes to it like to its own (``X-Kunlun-Device``
  then says ``node-b/cpu:0``).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from kunlun.cluster.member import (
    ASSIGN,
    NODES,
    REPLICAS,
    WORKLOADS,
    ClusterView,
    Membership,
    ReplicaStatus,
)
from kunlun.cluster.peer import PREFIX as PEER_PREFIX
from kunlun.engines import measured
from kunlun.errors import KunlunError
from kunlun.planner.cache import PlanCache
from kunlun.planner.model_info import inspect_model, locate_model
from kunlun.serving.replica import Replica, ReplicaSet
from kunlun.serving.routing import DeviceLoad, DeviceSamples
from kunlun.state.etcd_client import LeaseNotFound
from kunlun.state.store import WorkloadRecord
from kunlun.workload.manager import ACTIVE, WorkloadManager
from kunlun.workload.placement import place
from kunlun.workload.spec import parse_spec

HANDOVER_S = 90.0
DRAIN_S = 120.0
"""A replica handed over stops once its requests (this node's and those relayed from other
nodes) are answered, or after this long."""
SAMPLE_REFRESH_S = 4.0
"""A replica's report is written again at least this often, with its device's utilization
(in steps of 10 %), so other nodes' routing has a fresh reading of it."""


class LocalReplicas:
    def __init__(
        self,
        member: Membership,
        view: ClusterView,
        manager: WorkloadManager,
        replicas: ReplicaSet,
        samples: DeviceSamples,
    ) -> None:
        self.member, self.view, self.manager, self.replicas = member, view, manager, replicas
        self.samples = samples
        """The gateway's device readings: this node's are reported with its replicas, other
        nodes' are written here (``node-b/cpu:0``), so routing weighs every replica alike."""
        self.name = member.config.node_name
        self.failed: dict[str, tuple[str, int, str]] = {}
        """Replica id -> (workload, index, why) for replicas that could not run here."""
        self.reservations: dict[str, list[dict[str, Any]]] = {}
        self._published: dict[str, str] = {}
        self._published_at: dict[str, float] = {}
        self._draining: dict[str, float] = {}
        """Replicas handed to another node: out of routing since, until their requests end."""
        self.peer_in_flight: Callable[[str], int] = lambda rid: 0
        """Requests other nodes are relaying to a local replica (the peer port's count)."""
        self._handover: dict[str, float] = {}

    def replica_failed(self, workload_id: str, message: str) -> None:
        """A local worker gave up (the agent's ``failed`` event): report it so the leader
        places the replica elsewhere."""
        for rid, worker in list(self.manager.agent.workers.items()):
            if worker.replica.workload_id == workload_id:
                index = int(rid.rsplit("-r", 1)[1])
                self.failed[rid] = (workload_id, index, message)

    def reconcile(self) -> None:
        workloads = {wid: WorkloadRecord(**d) for wid, d in self.view.items(WORKLOADS).items()}
        assigns = self.view.items(ASSIGN)
        statuses = self.view.replica_statuses()
        want: dict[str, tuple[WorkloadRecord, int]] = {}
        for wid, assignment in assigns.items():
            record = workloads.get(wid)
            if record is None or record.state not in ACTIVE:
                continue
            for idx, node in (assignment.get("replicas") or {}).items():
                if node == self.name:
                    want[f"{wid}-r{idx}"] = (record, int(idx))
        for rid in list(self.failed):
            if rid not in want:
                del self.failed[rid]
        workers = self.manager.agent.workers
        for rid, worker in list(workers.items()):
            if rid in self.failed:
                self.manager.agent.stop_replica(rid)
            elif rid in self._draining:
                self._finish_drain(rid)
            elif rid not in want and self._handed_over(rid, worker.replica.workload_id,
                                                       workloads, assigns, statuses):  # fmt: skip
                # out of routing everywhere first; stopped once its requests are answered
                worker.stopping, worker.replica.ready = True, False
                self._draining[rid] = time.monotonic()
        for rid, (record, idx) in want.items():
            self._handover.pop(rid, None)
            if rid not in workers and rid not in self.failed:
                self._start(record, idx)
        self._publish()
        self._remote(statuses)

    def _finish_drain(self, rid: str) -> None:
        worker = self.manager.agent.workers.get(rid)
        if worker is None:
            self._draining.pop(rid, None)
            return
        busy = worker.replica.in_flight + self.peer_in_flight(rid)
        if busy and time.monotonic() - self._draining[rid] < DRAIN_S:
            return
        self._draining.pop(rid, None)
        left = f" ({busy} request(s) still in flight after {DRAIN_S:g} s)" if busy else ""
        self.manager.event(worker.replica.workload_id, "moved",
                           f"replica {rid} stopped on {self.name}: it runs elsewhere now{left}")  # fmt: skip
        self.manager.agent.stop_replica(rid)
        self.reservations.pop(rid, None)

    def _handed_over(
        self,
        rid: str,
        wid: str,
        workloads: dict[str, WorkloadRecord],
        assigns: dict[str, Any],
        statuses: dict[str, ReplicaStatus],
    ) -> bool:
        record = workloads.get(wid)
        idx = rid.rsplit("-r", 1)[1]
        node = (assigns.get(wid) or {}).get("replicas", {}).get(idx)
        if record is None or record.state not in ACTIVE or node is None:
            return True
        there = statuses.get(f"{node}/{rid}")
        if there is not None and there.ready:
            return True
        since = self._handover.setdefault(rid, time.monotonic())
        return time.monotonic() - since > HANDOVER_S

    def _start(self, record: WorkloadRecord, idx: int) -> None:
        """Plan replica ``idx`` on this node's devices and launch it; a failure is reported."""
        rid, wid = f"{record.workload_id}-r{idx}", record.workload_id
        manager = self.manager
        try:
            spec = parse_spec(record.spec, wid).model_copy(update={"replicas": 1})
            name, path = locate_model(manager.store, spec.model)
            if manager.guard is not None:
                manager.guard.admit(name, path, rehash=True)
            model = inspect_model(path, name)
            others = [r for k, v in self.reservations.items() if k != rid for r in v]
            placement = place(spec, manager.inventory(), model, others, starting=True,
                              measured=measured.for_model(manager.store, name))  # fmt: skip
        except KunlunError as exc:
            self.failed[rid] = (wid, idx, str(exc))
            manager.event(wid, "failed-here", f"replica {idx} cannot run on {self.name}: {exc}")
            return
        plan = placement.plans[0]
        entry = PlanCache(manager.agent.home).entry(plan, path, placement.groups[0])
        manager.agent.note(wid, f"plan_cache: {'hit' if entry.hit else 'miss'} (key {entry.key})")
        manager.agent.note(wid, "plan: " + plan.summary())
        manager.event(wid, "starting",
                      f"replica {idx} on {self.name}/{placement.target_device}")  # fmt: skip
        self.reservations[rid] = [r.to_dict() for r in placement.reservations]
        try:
            manager.launch_replica(record, spec, idx, plan, path, entry.path)
        except (KunlunError, OSError) as exc:  # e.g. the plan directory cannot be written
            self.failed[rid] = (wid, idx, f"cannot launch: {exc}")
            manager.event(wid, "failed-here", f"replica {idx} cannot start on {self.name}: {exc}")

    def _publish(self) -> None:
        """Report every local replica (and every failed one) under the node's lease."""
        lease = self.member.lease
        if lease == 0:
            return
        if self.member.rejoined.is_set():  # a new lease: every key again
            self.member.rejoined.clear()
            self._published.clear()
        current: dict[str, str] = {}
        now = time.monotonic()
        for rid, worker in list(self.manager.agent.workers.items()):
            r = worker.replica
            sample = self.samples.get(r.device)
            utilization = None if sample is None or sample.utilization_pct is None else (
                round(sample.utilization_pct, -1))  # fmt: skip
            current[rid] = ReplicaStatus(
                workload_id=r.workload_id, index=int(rid.rsplit("-r", 1)[1]), model=r.model,
                device=r.device, ready=r.ready, ejected=r.ejected, max_num_seqs=r.max_num_seqs,
                max_queue=r.max_queue, priority=r.priority,
                reservations=tuple(self.reservations.get(rid, [])),
                utilization_pct=utilization, max_model_len=r.max_model_len, created=r.created,
                task=r.task,
            ).to_json()  # fmt: skip
        for rid, (wid, idx, why) in self.failed.items():
            current[rid] = ReplicaStatus(workload_id=wid, index=idx, failed=why).to_json()
        base = self.member.key(f"{REPLICAS}{self.name}/")
        for rid, value in current.items():
            stale = now - self._published_at.get(rid, 0.0) > SAMPLE_REFRESH_S
            if self._published.get(rid) != value or stale:
                try:
                    self.member.etcd.put(base + rid, value, lease=lease)
                except LeaseNotFound:  # expired while this node was paused: a new one first
                    self.member.keepalive()
                    return
                self._published[rid], self._published_at[rid] = value, now
        for rid in [rid for rid in self._published if rid not in current]:
            self.member.etcd.delete(base + rid)
            del self._published[rid]

    def _remote(self, statuses: dict[str, ReplicaStatus]) -> None:
        """Other nodes' replicas, as the gateway routes to them."""
        nodes = self.view.items(NODES)
        seen = set()
        now = time.monotonic()
        for key, status in statuses.items():
            node, rid = key.split("/", 1)
            if node == self.name or node not in nodes or status.failed is not None:
                continue
            assert status.device is not None and status.model is not None  # a running one
            remote_id = f"{node}/{rid}"
            base_url = nodes[node]["peer_url"].rstrip("/") + PEER_PREFIX + rid
            seen.add(remote_id)
            replica = self.replicas.get(remote_id)
            if replica is None or replica.base_url != base_url:
                replica = Replica(
                    replica_id=remote_id,
                    workload_id=status.workload_id,
                    model=status.model,
                    device=f"{node}/{status.device}",
                    base_url=base_url,
                    max_queue=status.max_queue or Replica.max_queue,
                    priority=status.priority or Replica.priority,
                    max_num_seqs=status.max_num_seqs or Replica.max_num_seqs,
                    max_model_len=status.max_model_len,
                    created=status.created,
                    task=status.task or Replica.task,
                    node=node,
                )
                replica.ready = status.ready
                self.replicas.upsert(replica)
            else:
                replica.ready = status.ready and now >= replica.ejected_until
            replica.ejected = status.ejected  # its node's health checks took it out of routing
            if status.utilization_pct is not None:
                self.samples[replica.device] = DeviceLoad(status.utilization_pct, None,
                                                            time.time())  # fmt: skip
        for replica in self.replicas.all():
            if replica.node is not None and replica.replica_id not in seen:
                self.replicas.remove(replica.replica_id)
