"""Scaling a running workload: more or fewer replicas without restarting the ones it has.

:func:`scale` changes the spec's ``replicas`` (checked by the spec's own rule, 1 to 16) and:

- **down**: stops the replicas with the highest indices (``wl-x-r2`` before ``wl-x-r1``); the
  others keep serving, with the requests they hold;
- **up**: places the workload again for the new count (its own reservations left out, so
  the replicas it has count once) and launches only the new groups, ``r{n}`` on, each with
  its plan, as :meth:`~kunlun.workload.manager.WorkloadManager.start` launches them. A count
  that no longer fits is refused (400, ``replicas``) and nothing changes.

The record keeps the new spec and placement, so a daemon restart starts the new count. A
cluster node refuses: the leader places the replicas of a cluster (not built yet).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from kunlun.errors import ConfigError, KunlunError, Location
from kunlun.planner.cache import PlanCache
from kunlun.planner.model_info import inspect_model, locate_model
from kunlun.workload.spec import parse_spec

if TYPE_CHECKING:
    from kunlun.state.store import WorkloadRecord
    from kunlun.workload.manager import WorkloadManager

SCALABLE = ("LOADING", "RUNNING")


def replica_index(replica_id: str) -> int:
    """``wl-abc123-r2`` -> 2."""
    return int(replica_id.rsplit("-r", 1)[1])


def scale(manager: WorkloadManager, workload_id: str, replicas: int) -> WorkloadRecord:
    """Run ``replicas`` replicas of the workload (see the module docstring)."""
    record = manager.get(workload_id)
    where = Location("request", field="replicas")
    if manager.cluster is not None:
        raise ConfigError("scaling a workload on a cluster is not available yet: the "
                          "leader places its replicas", location=where)  # fmt: skip
    if record.state not in SCALABLE:
        raise ConfigError(f"workload {record.workload_id} is {record.state}: only a LOADING "
                          "or RUNNING workload scales", location=where)  # fmt: skip
    spec = parse_spec({**record.spec, "replicas": replicas}, "request body")
    mine = sorted(
        (r for r in manager.replicas.all() if r.workload_id == record.workload_id),
        key=lambda r: replica_index(r.replica_id),
    )
    before = int(record.spec.get("replicas", 1))
    if replicas < len(mine):
        for replica in mine[replicas:]:
            manager.agent.stop_replica(replica.replica_id)
        record.placement["reservations"] = record.placement.get("reservations", [])[:replicas]
    elif replicas > len(mine):
        name, path = locate_model(manager.store, spec.model)
        try:
            placement = manager.place_spec(spec, inspect_model(path, name), record.workload_id,
                                       starting=True)  # fmt: skip
        except KunlunError as exc:
            raise ConfigError(f"{replicas} replicas do not fit: {exc.message}",
                              location=where) from None  # fmt: skip
        cache = PlanCache(manager.agent.home)
        for i in range(len(mine), replicas):
            group, plan = placement.groups[i], placement.plans[i]
            entry = cache.entry(plan, path, group)
            manager.agent.note(record.workload_id, "plan: " + plan.summary())
            manager.launch_replica(record, spec, i, plan, path, entry.path)
        record.placement = {
            **placement.to_dict(),
            "plan_time_s": record.placement.get("plan_time_s"),
        }
    record.spec = spec.model_dump()
    record.updated = time.time()
    manager.store.put_workload(record)
    manager.event(record.workload_id, "scaled", f"replicas {before} -> {replicas}")
    return record
