"""The leader's controller: which node runs each replica of each workload.

Every tick, for each active workload, it keeps one node per replica index
(``cluster/assign/<workload>``): a replica whose node is gone (lease expired), draining, or
reports that it failed there is placed again. A node is judged with the same filters and
scorers as on one machine (:func:`kunlun.workload.placement.place`, one replica, over that
node's devices with the memory its replicas already hold); among the nodes that fit, the one
with the fewest replicas of this workload, then of all workloads, wins. The workload's state
follows its replicas: RUNNING once one serves, LOADING while placed ones load, FAILED when no
node can take it (with every node's reason).

Every write is fenced (:meth:`Membership.fenced`): a leader that lost its key writes nothing.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

from kunlun.cluster.member import (
    ASSIGN,
    DRAIN,
    NODES,
    WORKLOADS,
    ClusterView,
    Membership,
    ReplicaStatus,
)
from kunlun.device.inventory import Inventory
from kunlun.device.profile import DeviceProfile
from kunlun.engines import measured
from kunlun.errors import KunlunError
from kunlun.planner.model_info import ModelInfo, inspect_model, locate_model
from kunlun.state.etcd_wire import Op
from kunlun.state.store import EventRecord, StateStore, WorkloadRecord
from kunlun.workload.manager import ACTIVE
from kunlun.workload.placement import place
from kunlun.workload.spec import parse_spec

HEARTBEAT = "cluster/controller"


class Controller:
    def __init__(
        self,
        member: Membership,
        view: ClusterView,
        store: StateStore,
        record_event: Callable[[EventRecord], None],
    ) -> None:
        self.member, self.view, self.store = member, view, store
        self.record_event = record_event
        self._models: dict[str, ModelInfo] = {}
        self._beat = 0.0

    def tick(self) -> None:
        """One pass over every workload (only while this node leads)."""
        if not self._heartbeat():
            return
        nodes = self.view.items(NODES)
        live = {name for name in nodes if name not in self.view.items(DRAIN)}
        statuses = self.view.replica_statuses()
        load: dict[str, int] = {name: 0 for name in nodes}
        reserved: dict[str, list[dict[str, Any]]] = {name: [] for name in nodes}
        for key, status in statuses.items():
            node = key.split("/", 1)[0]
            if node in load:
                load[node] += 1
                reserved[node] += status.reservations
        assigns = self.view.items(ASSIGN)
        for wid, data in self.view.items(WORKLOADS).items():
            record = WorkloadRecord(**data)
            if record.state not in ACTIVE:
                if wid in assigns and not self.member.fenced([Op.delete(self._key(ASSIGN, wid))]):
                    return
                continue
            if not self._workload(record, assigns.get(wid), nodes, live, statuses, load, reserved):
                return

    def _heartbeat(self) -> bool:
        """A fenced write every third of the lease: how a paused leader finds out it no
        longer leads even when there is nothing to change."""
        now = time.monotonic()
        if now - self._beat < self.member.config.lease_ttl_s / 3:
            return self.member.leader
        self._beat = now
        value = {
            "leader": self.member.config.node_name,
            "term": self.member.term,
            "ts": time.time(),
        }
        return self.member.fenced([Op.put(self.member.key(HEARTBEAT), json.dumps(value))])

    def _key(self, sub: str, name: str) -> str:
        return self.member.key(sub + name)

    def _workload(
        self,
        record: WorkloadRecord,
        current: dict[str, Any] | None,
        nodes: dict[str, Any],
        live: set[str],
        statuses: dict[str, ReplicaStatus],
        load: dict[str, int],
        reserved: dict[str, list[dict[str, Any]]],
    ) -> bool:
        wid = record.workload_id
        current = current or {"replicas": {}, "avoid": {}}
        replicas: dict[str, str] = dict(current.get("replicas") or {})
        avoid: dict[str, dict[str, str]] = {
            k: dict(v) for k, v in (current.get("avoid") or {}).items()
        }
        reported = [(key.split("/", 1)[0], s) for key, s in statuses.items()
                    if s.workload_id == wid]  # fmt: skip
        for where, status in reported:
            idx = str(status.index)
            if status.failed and replicas.get(idx) == where:
                avoid.setdefault(idx, {})[where] = status.failed
                del replicas[idx]
        events: list[tuple[str, str]] = []
        spec = parse_spec(record.spec, wid)
        rejected: dict[str, str] = {}
        devices: dict[str, str] = {}
        for i in range(spec.replicas):
            idx = str(i)
            node = replicas.get(idx)
            if node is not None and node in live:
                continue
            choice = self._choose(record, idx, live, avoid.get(idx, {}), replicas, load, reserved,
                                  rejected)  # fmt: skip
            if choice is None:
                if node is not None and node in nodes:
                    continue  # draining, and nowhere else to go: it stays
                replicas.pop(idx, None)
                continue
            new, device, why = choice
            replicas[idx] = new
            devices[idx] = device
            load[new] += 1
            was = (
                f" (was on {node}: {'draining' if node in nodes else 'node lost'})" if node else ""
            )
            events.append(("placed", f"replica {idx} on node {new}, {device}{was}: {why}"))
        assignment = {"replicas": replicas, "avoid": avoid}
        state, reason = self._state(wid, replicas, statuses, spec.replicas, rejected, avoid)
        serving = sorted(f"{node}/{s.device}" for node, s in reported
                         if replicas.get(str(s.index)) == node and s.device)  # fmt: skip
        placed = [f"{replicas[i]}/{devices[i]}" for i in sorted(devices)]
        target = ", ".join(serving) or ", ".join(placed) or record.target_device
        placement = dict(record.placement)
        placement.update({"nodes": replicas, "rejected_nodes": rejected})
        ops: list[Op] = []
        if assignment != current:
            ops.append(Op.put(self._key(ASSIGN, wid), json.dumps(assignment)))
        if (state, reason, target, placement) != (record.state, record.reason,
                                                  record.target_device, record.placement):  # fmt: skip
            if state != record.state:
                events.append(("state", state + (f": {reason}" if reason else "")))
            record.state, record.reason, record.target_device = state, reason, target
            record.placement, record.updated = placement, time.time()
            ops.append(Op.put(self._key(WORKLOADS, wid), json.dumps(asdict(record))))
        if not ops:
            return True
        if not self.member.fenced(ops):
            return False
        for kind, message in events:
            self.record_event(EventRecord(wid, time.time(), kind, message))
        return True

    def _choose(
        self,
        record: WorkloadRecord,
        idx: str,
        live: set[str],
        avoid: dict[str, str],
        replicas: dict[str, str],
        load: dict[str, int],
        reserved: dict[str, list[dict[str, Any]]],
        rejected: dict[str, str],
    ) -> tuple[str, str, str] | None:
        """The node for replica ``idx``: ``(node, device, why)``, or None (reasons in
        ``rejected``)."""
        spec = parse_spec(record.spec, record.workload_id).model_copy(update={"replicas": 1})
        try:
            model = self._model(str(spec.model))
        except KunlunError as exc:
            rejected["*"] = str(exc)
            return None
        nodes = self.view.items(NODES)
        fits = []
        for name in sorted(live):
            if name in avoid:
                rejected[name] = f"replica {idx} failed there: {avoid[name]}"
                continue
            profiles = [DeviceProfile.from_dict(d) for d in nodes[name].get("devices") or []]
            try:
                placement = place(spec, Inventory(profiles, []), model, reserved.get(name, []),
                                  measured=measured.for_model(self.store, model.name))  # fmt: skip
            except KunlunError as exc:
                rejected[name] = str(exc)
                continue
            same = sum(1 for node in replicas.values() if node == name)
            fits.append(((same, load.get(name, 0), name), name, placement))
        if not fits:
            return None
        _, name, placement = min(fits, key=lambda f: f[0])
        reserved.setdefault(name, []).extend(r.to_dict() for r in placement.reservations)
        others = len(fits) - 1
        why = placement.why + (f"; fewest replicas of {len(fits)} nodes that fit" if others else "")
        return name, placement.target_device, why

    def _model(self, name: str) -> ModelInfo:
        if name not in self._models:
            alias, path = locate_model(self.store, name)
            self._models[name] = inspect_model(path, alias)
        return self._models[name]

    def _state(
        self,
        wid: str,
        replicas: dict[str, str],
        statuses: dict[str, ReplicaStatus],
        wanted: int,
        rejected: dict[str, str],
        avoid: dict[str, dict[str, str]],
    ) -> tuple[str, str | None]:
        # a replica handing over to another node still serves: it counts
        ready = [key for key, s in statuses.items() if s.workload_id == wid and s.ready]
        if ready:
            missing = wanted - len(replicas)
            return "RUNNING", (f"{missing} replica(s) not placed: {_reasons(rejected)}"
                               if missing else None)  # fmt: skip
        if replicas:
            return "LOADING", None
        tried = {node: why for per in avoid.values() for node, why in per.items()}
        if not tried and not rejected:
            return "PENDING", "no node is available"
        return "FAILED", f"no node can run it: {_reasons({**tried, **rejected})}"


def _reasons(rejected: dict[str, str]) -> str:
    return "; ".join(f"{node}: {why}" for node, why in sorted(rejected.items())) or "no node"
