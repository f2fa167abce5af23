"""The workload manager: submit, place, start, describe and stop workloads.

A workload moves PENDING -> PLANNING -> LOADING -> RUNNING, or ends FAILED or STOPPED with the
reason. Submitting resolves the model, chooses devices (:mod:`kunlun.workload.placement`),
records the decision (``target_device`` and why) and asks the node agent for one worker per
replica. Workloads are durable: a restarted daemon starts again every workload that was not
stopped or failed.
"""

from __future__ import annotations

import json
import os
import secrets
import shlex
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from kunlun.device.inventory import Inventory
from kunlun.device.registry import load_plugins
from kunlun.engines import measured
from kunlun.engines.registry import engine_command, engine_named
from kunlun.errors import ConfigError, KunlunError, Location, ModelError
from kunlun.node.agent import NodeAgent
from kunlun.offline.integrity import Finding, ModelGuard
from kunlun.planner.cache import LAUNCH_FILE, PlanCache
from kunlun.planner.launch import engine_launch
from kunlun.planner.model_info import ModelInfo, inspect_model, locate_model
from kunlun.planner.plan import ExecutionPlan
from kunlun.sandbox import memory_cap_mb
from kunlun.serving.replica import Replica, ReplicaSet
from kunlun.state.store import EventRecord, StateStore, WorkloadRecord
from kunlun.telemetry.spec import worker_profiling
from kunlun.workload.placement import Placement, place
from kunlun.workload.spec import WorkloadSpec, current_names, parse_spec

ACTIVE = ("PENDING", "PLANNING", "LOADING", "RUNNING")


class ClusterHooks(Protocol):
    """What the manager asks of the cluster node it belongs to."""

    @property
    def name(self) -> str: ...

    def replica_failed(self, workload_id: str, message: str) -> None: ...

    def record_event(self, event: EventRecord) -> None: ...

    def wake(self) -> None: ...


class WorkloadManager:
    def __init__(
        self,
        store: StateStore,
        agent: NodeAgent,
        replicas: ReplicaSet,
        inventory: Callable[[], Inventory],
        guard: ModelGuard | None = None,
    ) -> None:
        self.store = store
        self.agent = agent
        self.replicas = replicas
        self.inventory = inventory
        self.guard = guard
        """Which models may be served (signed packages, re-hashed at each start)."""
        self.cluster: ClusterHooks | None = None
        """In a cluster (:mod:`kunlun.cluster`): the leader places replicas on nodes and sets
        workload states; this node only records workloads and runs what it is assigned."""

    # ---- events ----
    def event(self, workload_id: str, kind: str, message: str) -> None:
        if kind == "ready" and self.guard is not None and self.guard.sealing(workload_id):
            threading.Thread(target=self._seal, args=(workload_id,), daemon=True,
                             name=f"seal-{workload_id}").start()  # fmt: skip
        if self.cluster is not None:  # written in the background: etcd may be slow or away
            self.cluster.record_event(
                EventRecord(workload_id, time.time(), kind, f"{self.cluster.name}: {message}")
            )
            if kind == "failed":
                self.cluster.replica_failed(workload_id, message)
            self.cluster.wake()
            return
        self.store.add_event(EventRecord(workload_id, time.time(), kind, message))
        if kind == "failed":
            record = self.store.get_workload(workload_id)
            if record is not None and record.state in ACTIVE:
                self.agent.stop_workload(workload_id)
                self._set(record, "FAILED", message)
        elif kind in ("ready", "crashed"):
            self._refresh_state(workload_id)

    def _set(self, record: WorkloadRecord, state: str, reason: str | None = None) -> None:
        record.state, record.reason, record.updated = state, reason, time.time()
        self.store.put_workload(record)
        self.event(record.workload_id, "state", f"{state}" + (f": {reason}" if reason else ""))

    def _refresh_state(self, workload_id: str) -> None:
        record = self.store.get_workload(workload_id)
        if record is None or record.state not in ("LOADING", "RUNNING"):
            return
        mine = [r for r in self.replicas.all() if r.workload_id == workload_id]
        state = "RUNNING" if mine and any(r.ready for r in mine) else "LOADING"
        if state != record.state:
            self._set(record, state)

    # ---- submit ----
    def plan(self, spec: WorkloadSpec, exclude: str | None = None) -> Placement:
        """Where ``spec`` would run and its plan, with the reasons; raises when nowhere fits.

        Memory reserved by the other active workloads (all but ``exclude``) counts as used.
        """
        name, path = locate_model(self.store, spec.model)
        return self.place_spec(spec, inspect_model(path, name), exclude, starting=False)

    def place_spec(
        self, spec: WorkloadSpec, model: ModelInfo, exclude: str | None, *, starting: bool
    ) -> Placement:
        """Where ``spec`` runs now, memory reserved by every other active workload counted as
        used (all but ``exclude``), ``engine: auto`` choosing by the model's measurements."""
        reservations = [
            r
            for w in self.store.list_workloads()
            if w.state in ACTIVE and w.workload_id != exclude
            for r in w.placement.get("reservations", [])
        ]
        return place(spec, self.inventory(), model, reservations, starting=starting,
                     measured=measured.for_model(self.store, model.name))  # fmt: skip

    def submit(
        self, spec: WorkloadSpec, dry_run: bool = False, canary_of: str | None = None
    ) -> WorkloadRecord:
        """Create and start a workload (or, with ``dry_run``, only say where it would run).

        An unknown model or a placement that cannot work is refused here, before anything is
        recorded; a model whose files cannot be read is recorded and ends FAILED with the
        reason (as when a worker cannot load it). ``canary_of``: the workload this one is a
        rollout's canary of (it serves the same model name next to it).
        """
        record = self._new_record(spec, canary_of)
        if dry_run and self.cluster is not None:
            raise ConfigError(
                "a dry run is not available on a cluster node yet: the leader places replicas "
                "over every node's devices",
                location=Location("dry_run"),
                hint="kunlun-cli node list shows each node's devices; kunlun-cli plan MODEL "
                "--device D plans one device",
            )
        name, path = locate_model(self.store, spec.model)
        if self.guard is not None:
            self.guard.admit(name, path, rehash=False)
        try:
            model = inspect_model(path, name)
        except ModelError:
            if dry_run:
                raise
            model = None
        if model is not None and self.cluster is None:
            placement = self.place_spec(spec, model, None, starting=False)
            if dry_run:
                record.state, record.target_device = "PLANNING", placement.target_device
                record.placement = placement.to_dict()
                return record
        self.store.put_workload(record)
        self.event(record.workload_id, "submitted", f"spec: {spec_line(spec)}")
        if self.cluster is None:
            self.start(record)
        return record

    def create(self, spec: WorkloadSpec) -> WorkloadRecord:
        """Record a new PENDING workload (started by :meth:`start` or :meth:`resume_all`)."""
        record = self._new_record(spec)
        self.store.put_workload(record)
        self.event(record.workload_id, "submitted", f"spec: {spec_line(spec)}")
        return record

    def _new_record(self, spec: WorkloadSpec, canary_of: str | None = None) -> WorkloadRecord:
        name = spec.served_name
        for other in self.store.list_workloads():
            if other.state in ACTIVE and other.name == name and other.workload_id != canary_of:
                if another_engine(spec.engine, other):
                    continue  # one pool per engine (kunlun.serving.pools)
                raise ConfigError(
                    f"a workload already serves {name!r} ({other.workload_id}, {other.state})",
                    location=Location("name"),
                    hint=f"stop it first (kunlun-cli workload stop {other.workload_id}), pass --name, "
                    "or serve it on another engine (--engine) next to it",
                )
        now = time.time()
        return WorkloadRecord(
            workload_id=f"wl-{secrets.token_hex(3)}",
            name=name,
            spec=spec.model_dump(),
            created=now,
            updated=now,
        )

    def start(self, record: WorkloadRecord) -> None:
        """Plan and launch ``record``; a planning error ends it FAILED with the reason."""
        spec = parse_spec(record.spec, record.workload_id)
        self._set(record, "PLANNING")
        started = time.monotonic()
        try:
            name, path = locate_model(self.store, spec.model)
            if self.guard is not None:
                self.guard.admit(name, path, rehash=True)
            model = inspect_model(path, name)
            placement = self.place_spec(spec, model, record.workload_id, starting=True)
        except KunlunError as exc:
            self._set(record, "FAILED", str(exc))
            return
        record.target_device = placement.target_device
        record.placement = placement.to_dict()
        record.placement["plan_time_s"] = round(time.monotonic() - started, 3)
        self.event(
            record.workload_id,
            "placed",
            f"target_device {placement.target_device}: {placement.why}",
        )
        self._set(record, "LOADING")
        cache = PlanCache(self.agent.home)
        for i, (group, plan) in enumerate(zip(placement.groups, placement.plans, strict=True)):
            entry = cache.entry(plan, path, group)
            wid = record.workload_id
            self.agent.note(wid, f"plan_cache: {'hit' if entry.hit else 'miss'} (key {entry.key})")
            self.agent.note(wid, "plan: " + plan.summary())
            try:
                self.launch_replica(record, spec, i, plan, path, entry.path)
            except KunlunError as exc:  # e.g. a plan setting its engine cannot express
                self.agent.stop_workload(wid)
                self._set(record, "FAILED", str(exc))
                return

    def launch_replica(
        self,
        record: WorkloadRecord,
        spec: WorkloadSpec,
        i: int,
        plan: ExecutionPlan,
        model_dir: Path,
        plan_dir: Path,
    ) -> None:
        """Start replica ``i`` of ``record`` with ``plan`` (its embedded worker or external
        engine server) on the node agent; its model files from ``model_dir``, its plan cache
        entry ``plan_dir`` (with ``--require-signed``, what it holds derived from a package is
        checked against its seal first: :meth:`ModelGuard.check_conversion`)."""
        if self.guard is not None:
            line = self.guard.check_conversion(record.name, model_dir, plan_dir,
                                               record.workload_id)  # fmt: skip
            if line is not None:
                self.agent.note(record.workload_id, line)
            if self.guard.stops:
                self._stop_failed(self.guard.take_stops(), self.serving())
        threads = plan.engine_options.get("num_threads") or max(
            1, (os.cpu_count() or 1) // spec.replicas
        )
        replica = Replica(
            replica_id=f"{record.workload_id}-r{i}",
            workload_id=record.workload_id,
            model=record.name,
            device=plan.devices[0],
            base_url="",
            max_queue=spec.max_queue,
            priority=spec.priority,
            max_num_seqs=plan.max_num_seqs,
            max_model_len=plan.max_model_len,
            created=int(record.created),
            task=spec.task,
            engine=plan.engine,
        )
        plugin = load_plugins().plugins.get(plan.device_type)
        runtime_env = plugin.runtime_env if plugin is not None else ()
        env = self.agent.worker_env(replica.replica_id, plan.env, runtime_env, int(threads))
        host_kv_mb = plan.kv_cache_memory_mb if plan.torch_device == "cpu" else 0
        cap_mb = memory_cap_mb(plan.weight_memory_mb, host_kv_mb, spec.memory_cap_mb)
        launch = None
        if engine_named(plan.engine).takes_launch_file:  # the embedded engine's worker
            launch = engine_launch(plan, plugin, model_dir, record.name, plan_dir, int(threads),
                                   stream_interval=spec.stream_interval, faults=spec.faults,
                                   chat_template=spec.chat_template,
                                   task=spec.task, pooling=spec.embed_pooling,
                                   **worker_profiling(spec.telemetry, self.agent.log_dir,
                                                      replica.replica_id))  # fmt: skip
            launch.write(plan_dir / LAUNCH_FILE)
        command = engine_command(plan, model_dir, record.name, int(threads),
                                 self.agent.log_path(record.workload_id), plan_dir,
                                 self.agent.launch_file(replica.replica_id))  # fmt: skip
        self.agent.note(record.workload_id, "engine: " + shlex.join(command.argv))
        self.agent.launch(replica, command, {**env, **command.env}, memory_cap_mb=cap_mb,
                          launch=launch)  # fmt: skip

    def resume_all(self) -> None:
        """After a daemon (re)start: start again every workload that was active (in a cluster,
        the leader's assignments say what this node runs)."""
        if self.cluster is not None:
            return
        for record in self.store.list_workloads():
            if record.state in ACTIVE:
                self.event(
                    record.workload_id, "resumed", "daemon restarted; starting the workload again"
                )
                self.start(record)

    # ---- queries and stop ----
    def get(self, workload_id: str) -> WorkloadRecord:
        record = self.store.get_workload(workload_id)
        if record is None:  # a name: its newest active workload, else its newest
            named = [w for w in reversed(self.store.list_workloads()) if w.name == workload_id]
            record = next((w for w in named if w.state in ACTIVE), named[0] if named else None)
        if record is None:
            known = ", ".join(w.workload_id for w in self.store.list_workloads()) or "none"
            raise ConfigError(
                f"no workload {workload_id!r}; known: {known}", location=Location("JOB")
            )
        return record

    def describe(self, workload_id: str) -> dict[str, Any]:
        record = self.get(workload_id)
        events = self.store.list_events(record.workload_id)
        replicas = []
        for r in self.replicas.all():
            if r.workload_id == record.workload_id:
                worker = self.agent.workers.get(r.replica_id)
                info = worker.info if worker else None
                replicas.append(
                    {
                        "replica_id": r.replica_id,
                        "device": r.device,
                        "engine": r.engine,
                        "ranks": [r.model_dump() for r in info.ranks] if info else [],
                        "ready": r.ready,
                        "pid": r.pid,
                        "base_url": r.base_url,
                        "in_flight": r.in_flight,
                        "restarts": worker.restarts if worker else 0,
                        "startup": info.model_dump(exclude_none=True) if info else {},
                    }
                )
        return {
            "workload_id": record.workload_id,
            "name": record.name,
            "state": record.state,
            "reason": record.reason,
            "target_device": record.target_device,
            "placement": record.placement,
            "spec": current_names(record.spec),  # a spec stored before a rename too
            "created": record.created,
            "updated": record.updated,
            "replicas": replicas,
            "events": [{"ts": e.ts, "kind": e.kind, "message": e.message} for e in events],
        }

    def serving(self) -> dict[str, tuple[Path, list[str]]]:
        """Each active workload's model: alias -> (directory, workload ids)."""
        out: dict[str, tuple[Path, list[str]]] = {}
        for record in self.store.list_workloads():
            if record.state not in ACTIVE:
                continue
            try:
                name, path = locate_model(self.store, str(record.spec.get("model")))
            except KunlunError:
                continue
            out.setdefault(name, (path, []))[1].append(record.workload_id)
        return out

    def integrity_sweep(self) -> list[Finding]:
        """Re-check what is served (:meth:`ModelGuard.sweep`); a model that fails stops: its
        workloads end FAILED with the finding as the reason."""
        if self.guard is None:
            return []
        serving = self.serving()
        active = [wid for _path, ids in serving.values() for wid in ids]
        findings = self.guard.sweep({name: path for name, (path, _) in serving.items()}, active)
        self._stop_failed(findings, serving)
        return findings

    def _seal(self, workload_id: str) -> None:
        """A replica of ``workload_id`` is ready: seal the conversion it made
        (:meth:`ModelGuard.seal`); one changed since it was made stops its workloads."""
        assert self.guard is not None
        try:
            findings = self.guard.seal(workload_id)
            if findings:
                self._stop_failed(findings, self.serving())
        except Exception as exc:  # noqa: BLE001 - a thread of its own: say it, never raise
            print(f"sealing the conversion of {workload_id} failed: {exc!r}", flush=True)

    def _stop_failed(
        self, findings: list[Finding], serving: dict[str, tuple[Path, list[str]]]
    ) -> None:
        """End FAILED the workloads each failed finding concerns (a package's: every workload
        of it, or those the finding names; the platform's: all, with ``--require-signed``)."""
        assert self.guard is not None
        packages = {name: self.guard.package_of(path) for name, (path, _) in serving.items()}
        for finding in findings:
            if finding.ok:
                continue
            for name, (_path, ids) in serving.items():
                package = packages[name]
                hit = finding.kind == "platform" and self.guard.require_signed
                if hit or (package is not None and package.name == finding.name):
                    for wid in ids:
                        if finding.workloads is not None and wid not in finding.workloads:
                            continue
                        self.event(wid, "failed", f"integrity check failed: {finding.describe()}")
                        self.guard.audit.write("stopped", workload=wid, model=name,
                                               reason=finding.describe())  # fmt: skip

    def stop(self, workload_id: str) -> WorkloadRecord:
        record = self.get(workload_id)
        self.agent.stop_workload(record.workload_id)
        if self.cluster is not None and record.state in ACTIVE:  # the other nodes stop theirs
            record.state, record.reason, record.updated = (
                "STOPPED",
                "stopped by request",
                time.time(),
            )
            self.store.put_workload(record)
            self.event(record.workload_id, "state", "STOPPED: stopped by request")
        elif record.state in ACTIVE:
            self._set(record, "STOPPED", "stopped by request")
        return record


def spec_line(spec: WorkloadSpec) -> str:
    """The fields a spec sets, as ``key=value`` pairs (nested ones as JSON) for an event."""
    return ", ".join(
        f"{k}={v if isinstance(v, str | int | float | bool) else json.dumps(v)}"
        for k, v in spec.model_dump(exclude_defaults=True, mode="json").items()
    )


def another_engine(requested: str, other: WorkloadRecord) -> bool:
    """Whether a new workload asking for engine ``requested`` may serve the same name as
    ``other``: both name their engine (``auto`` might choose the same one) and they differ.
    The gateway then routes the name to either, and ``X-Kunlun-Pool: cpu/<engine>`` to one."""
    chosen = (other.placement.get("engine") or {}).get("chosen") or other.spec.get("engine")
    return requested != "auto" and chosen not in (None, "auto", requested)
