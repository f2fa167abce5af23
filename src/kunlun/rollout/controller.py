"""The rollout controller: starts a canary next to its baseline, moves its share of traffic
step by step while the gates pass, and promotes it or rolls it back on its own.

A rollout goes ``STARTING`` (the canary workload is placed and loads) -> ``PROGRESSING``
(step by step: the canary gets ``steps[i]`` percent of the model's requests; after
``interval_s`` a step whose gates all pass moves on, one with an inconclusive gate waits, one
whose gate fails rolls back at once) -> ``PROMOTED`` (the last step reached 100 %: the
baseline drains and stops, the canary serves alone) or ``ROLLED_BACK`` (a gate failed, or
the canary could not start: its share goes to 0, it drains and stops) or ``ABORTED``
(``rollout abort``). ``rollout promote`` promotes at once, whatever the gates say.

The records live in the state store, so a restarted daemon goes on from the step it was in
(its gate window starts again: the counts were in memory). Every node applies the splits of
the records to its gateway (:meth:`apply_splits`); only the leader of a cluster (any node
alone) advances rollouts, with its writes fenced (:mod:`kunlun.cluster.rollouts`), and the
gates then see every node's counts. Promote and abort are requests the advancing node
carries out at its next tick (:meth:`request`).
"""

from __future__ import annotations

import copy
import secrets
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from typing import Any

from prometheus_client.core import Metric

from kunlun.errors import ConfigError, KunlunError, Location
from kunlun.planner.model_info import locate_model
from kunlun.rollout.gates import FAIL, PASS, evaluate
from kunlun.rollout.metrics import Totals, rollout_families
from kunlun.rollout.records import (
    RUNNING_STATES,
    canary_weight,
    failed,
    finished_step,
    newer,
    reason_kind,
    refuse_start,
    split_weight,
    steps_text,
)
from kunlun.rollout.spec import RolloutSpec
from kunlun.serving.canary_split import Split
from kunlun.serving.canary_window import BASELINE, CANARY, VersionWindow
from kunlun.serving.gateway_state import GatewayState
from kunlun.serving.replica import ReplicaSet
from kunlun.state.store import RolloutRecord, StateStore
from kunlun.workload.manager import ACTIVE, WorkloadManager
from kunlun.workload.spec import current_names, parse_spec

TICK_S = 0.5
START_TIMEOUT_S = 900.0
"""A canary not serving this long after its rollout began is rolled back."""
DRAIN_S = 60.0
"""Longest wait for a stopping version's requests in flight to finish."""
WRITE_EVERY_S = 2.0
"""The gates' latest values are written at most this often (each change of verdict at once)."""


@dataclass
class ClusterHooks:
    """How a cluster node changes the controller (:mod:`kunlun.cluster.rollouts`)."""

    leader: Callable[[], bool]
    write: Callable[[RolloutRecord], bool]
    """A fenced write; False when this node no longer leads."""
    records: Callable[[], list[RolloutRecord]]
    requests: Callable[[], dict[str, str]]
    """Promote and abort requests from any node: rollout id -> action."""
    request: Callable[[str, str], None]
    done: Callable[[str], None]
    """Forget a carried-out request."""
    remote_windows: Callable[[str, int], list[dict[str, VersionWindow]]]
    """Other nodes' counts of a rollout's step."""
    publish: Callable[[], None]
    """Publish this node's counts for the others."""


class RolloutController:
    def __init__(
        self,
        store: StateStore,
        manager: WorkloadManager,
        gateway: GatewayState,
        replicas: ReplicaSet,
    ) -> None:
        self.store, self.manager, self.gateway, self.replicas = store, manager, gateway, replicas
        self.cluster: ClusterHooks | None = None
        self.totals = Totals()
        self._requests: dict[str, str] = {}
        self._mine: dict[str, RolloutRecord] = {}
        """The latest record of each rollout this node wrote."""
        self._written: dict[str, tuple[float, tuple[str, ...]]] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._resumed = False

    # ---- the API ----
    def create(self, spec: RolloutSpec) -> RolloutRecord:
        """Start a rollout: the canary workload is submitted (placed by the normal
        scheduler) and the rollout recorded STARTING. Refused with the reason when the
        workload is not running, already has a rollout, or the model or overrides are bad."""
        baseline = self.manager.get(spec.workload)
        refuse_start(baseline, spec, self.records)
        canary_model, _ = locate_model(self.store, spec.model)
        data = {**current_names(baseline.spec), **current_names(spec.overrides),
                "model": spec.model, "name": baseline.name}  # fmt: skip
        canary_spec = parse_spec(data, "overrides")
        rollout_id = f"ro-{secrets.token_hex(3)}"
        canary = self.manager.submit(canary_spec, canary_of=baseline.workload_id)
        now = time.time()
        record = RolloutRecord(
            rollout_id=rollout_id,
            workload_id=baseline.workload_id,
            canary_workload_id=canary.workload_id,
            model=baseline.name,
            baseline_model=str(baseline.spec.get("model")),
            canary_model=canary_model,
            steps=list(spec.steps),
            interval_s=spec.interval_s,
            max_error_rate=spec.max_error_rate,
            max_p95_regression=spec.max_p95_regression,
            min_requests=spec.needed_requests(),
            created=now,
            updated=now,
            canary_spec=canary_spec.model_dump(exclude_defaults=True),
        )
        self.store.put_rollout(record)
        self._events(record, f"rollout {rollout_id} started: canary {canary.workload_id} "
                     f"({canary_model}) next to {baseline.workload_id}, steps "
                     f"{steps_text(record.steps)}, every {record.interval_s:g} s")  # fmt: skip
        self._wake.set()
        return record

    def get(self, rollout_id: str) -> RolloutRecord:
        records = self.records()
        found = next((r for r in records if r.rollout_id == rollout_id), None)
        if found is None:  # a workload id or name: its newest rollout
            found = next((r for r in reversed(records)
                          if rollout_id in (r.workload_id, r.canary_workload_id, r.model)), None)  # fmt: skip
        if found is None:
            known = ", ".join(r.rollout_id for r in records) or "none"
            raise ConfigError(
                f"no rollout {rollout_id!r}; known: {known}", location=Location("ROLLOUT")
            )
        return found

    def records(self) -> list[RolloutRecord]:
        """Every rollout; one this node wrote more recently than the store (or the cluster's
        watch) shows yet is taken from what it wrote."""
        found = self.cluster.records() if self.cluster is not None else self.store.list_rollouts()
        with self._lock:
            return [newer(r, self._mine.get(r.rollout_id)) for r in found]

    def status(self, record: RolloutRecord) -> dict[str, Any]:
        """The record as the API shows it, with the weights and the time to the next step."""
        weight = canary_weight(record)
        out = asdict(record)
        out["weights"] = {BASELINE: round(100 - weight, 3), CANARY: round(weight, 3)}
        out["next_step_in_s"] = None
        if record.state == "PROGRESSING":
            left = record.step_started + record.interval_s - time.time()
            out["next_step_in_s"] = round(max(0.0, left), 1)
        return out

    def request(
        self, rollout_id: str, action: str, wait_s: float = DRAIN_S + 30.0
    ) -> RolloutRecord:
        """Ask for ``promote`` or ``abort``; waits (up to ``wait_s``) until it is done: the
        rollout ended and the losing version stopped (``retired``), so that what the caller
        reads next (``workload list``) already shows it."""
        record = self.get(rollout_id)
        if record.state not in RUNNING_STATES:
            raise ConfigError(
                f"rollout {record.rollout_id} already ended ({record.state}"
                + (f": {record.reason}" if record.reason else "")
                + ")",
                location=Location("ROLLOUT"),
            )
        if self.cluster is not None:
            self.cluster.request(record.rollout_id, action)
        else:
            with self._lock:
                self._requests[record.rollout_id] = action
        self._wake.set()
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            current = self.get(record.rollout_id)
            if current.state not in RUNNING_STATES and current.retired is not None:
                return current
            time.sleep(0.1)
        return self.get(record.rollout_id)

    # ---- the loop ----
    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="kunlun-rollouts", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=DRAIN_S + 10)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.tick()
            except Exception:  # noqa: BLE001 - the loop must outlive one bad pass
                print("rollout controller: " + traceback.format_exc(), flush=True)
                self._stop.wait(1.0)
            self._wake.wait(TICK_S)
            self._wake.clear()

    def tick(self) -> None:
        """Apply the splits; on the advancing node, move every running rollout on."""
        records = self.records()
        self.apply_splits(records)
        keep = [(r.rollout_id, r.window) for r in records if r.state == "PROGRESSING"]
        self.gateway.rollout_stats.forget(keep)
        if self.cluster is not None:
            self.cluster.publish()
            if not self.cluster.leader():
                return
        elif not self._resumed:
            self._resumed = True
            self._restart_windows(records)
        requests = self._take_requests()
        for record in records:
            if self._stop.is_set():
                return
            if record.state in RUNNING_STATES:
                self._advance(record, requests.get(record.rollout_id))
            elif record.retired is None:  # ended, but the daemon stopped before the loser did
                self._retire(record)

    def apply_splits(self, records: list[RolloutRecord]) -> None:
        """Give the gateway the split of every model with a rollout: the step's weight while
        it progresses, and after it ends 0 or 100 % until the losing version's replicas are
        gone (both versions serve the same name: without a split they would share it)."""
        splits: dict[str, Split] = {}
        present = {r.workload_id for r in self.replicas.all()}
        for r in records:
            weight = split_weight(r, present)
            if weight is not None:
                splits[r.model] = Split(r.rollout_id, r.window, weight, r.workload_id,
                                        r.canary_workload_id)  # fmt: skip
        current = self.gateway.splits
        for model in [m for m in current if m not in splits]:
            del current[model]
        current.update(splits)

    # ---- one rollout ----
    def _advance(self, record: RolloutRecord, action: str | None) -> None:
        if action == "abort":
            self._roll_back(record, "ABORTED", "aborted by request")
            return
        if action == "promote":
            self._promote(record, "promoted by request")
            return
        canary = self.store.get_workload(record.canary_workload_id)
        baseline = self.store.get_workload(record.workload_id)
        if canary is None or canary.state not in ACTIVE:
            state = "gone" if canary is None else canary.state
            why = "" if canary is None or not canary.reason else f": {canary.reason}"
            self._roll_back(record, "ROLLED_BACK", f"the canary workload "
                            f"{record.canary_workload_id} is {state}{why}")  # fmt: skip
            return
        if baseline is None or baseline.state not in ACTIVE:
            self._promote(record, f"the baseline workload {record.workload_id} ended; the "
                          "canary serves alone")  # fmt: skip
            return
        now = time.time()
        if record.state == "STARTING":
            if canary.state == "RUNNING":
                self._step(record, 0, now)
            elif now - record.created > START_TIMEOUT_S:
                self._roll_back(record, "ROLLED_BACK", f"the canary was not serving "
                                f"{START_TIMEOUT_S:g} s after the rollout began")  # fmt: skip
            return
        results = evaluate(self._windows(record), record.max_error_rate,
                           record.max_p95_regression, record.min_requests)  # fmt: skip
        record.gates = [g.to_dict() for g in results]
        errors = [g for g in results if g.verdict == FAIL and g.gate == "error_rate"]
        slower = [g for g in results if g.verdict == FAIL and g.gate != "error_rate"]
        if errors:  # errors are unambiguous: at once
            self._roll_back(record, "ROLLED_BACK", failed(errors + slower))
        elif now - record.step_started < record.interval_s:
            self._write_gates(record, now)
        elif slower and record.suspect is not None:  # a second window, slower again
            self._roll_back(record, "ROLLED_BACK", f"{failed(slower)} (and in the window "
                            f"before: {record.suspect})")  # fmt: skip
        elif slower:
            # latency moves with whatever else the machine does for seconds at a time:
            # a regression counts once a fresh window shows it again
            record.suspect = failed(slower)
            self._new_window(record, now)
            if self._write(record):
                self._events(record, f"rollout {record.rollout_id}: step {record.step + 1} "
                             f"measured again over a fresh window: {record.suspect}")  # fmt: skip
        elif all(g.verdict == PASS for g in results):
            if record.step + 1 >= len(record.steps) or record.steps[record.step + 1] >= 100:
                self._promote(record, f"every gate passed at {steps_text(record.steps[:-1])} %")
            else:
                self._step(record, record.step + 1, now)
        else:
            self._write_gates(record, now)

    def _windows(self, record: RolloutRecord) -> dict[str, VersionWindow]:
        windows = self.gateway.rollout_stats.window(record.rollout_id, record.window)
        if self.cluster is not None:
            for other in self.cluster.remote_windows(record.rollout_id, record.window):
                for role, window in other.items():
                    if role in windows:
                        windows[role].merge(window)
        return windows

    def _step(self, record: RolloutRecord, step: int, now: float) -> None:
        self._new_window(record, now)  # the window of the step before ends
        record.state, record.step, record.suspect = "PROGRESSING", step, None
        if self._write(record):
            self._events(record, f"rollout {record.rollout_id}: step {step + 1} of "
                         f"{len(record.steps) - 1}, canary at {record.steps[step]:g} % of "
                         f"{record.model}")  # fmt: skip

    def _new_window(self, record: RolloutRecord, now: float) -> None:
        if record.gates:
            record.history.append(finished_step(record, now))
        record.window += 1
        record.step_started, record.gates = now, []

    def _promote(self, record: RolloutRecord, why: str) -> None:
        self._end(record, "PROMOTED", why)
        if self._write(record):
            self.totals.promotions[record.model] = self.totals.promotions.get(record.model, 0) + 1
            self._events(record, f"rollout {record.rollout_id} PROMOTED: {why}; "
                         f"{record.canary_workload_id} now serves {record.model}")  # fmt: skip
            self._retire(record)

    def _roll_back(self, record: RolloutRecord, state: str, why: str) -> None:
        self._end(record, state, why)
        if self._write(record):
            kind = "aborted" if state == "ABORTED" else reason_kind(why)
            key = (record.model, kind)
            self.totals.rollbacks[key] = self.totals.rollbacks.get(key, 0) + 1
            self._events(record, f"rollout {record.rollout_id} {state}: {why}; the canary's "
                         f"share is 0 and {record.canary_workload_id} stops")  # fmt: skip
            print(f"rollout {record.rollout_id} {state}: {why}", flush=True)
            self._retire(record)

    def _end(self, record: RolloutRecord, state: str, why: str) -> None:
        now = time.time()
        if record.step >= 0:
            record.history.append(finished_step(record, now))
        record.state, record.reason, record.finished = state, why, now

    def _retire(self, record: RolloutRecord) -> None:
        """Stop the losing version once the split sends it nothing and its requests are
        answered; then the rollout is ``retired``."""
        if record.state == "PROMOTED":
            workload_id = record.workload_id
            why = f"replaced by {record.canary_workload_id} (rollout {record.rollout_id} promoted)"
        else:
            workload_id, why = (
                record.canary_workload_id,
                f"rollout {record.rollout_id} {record.state}",
            )
        self.apply_splits(self.records())
        deadline = time.monotonic() + DRAIN_S
        while time.monotonic() < deadline and any(
            r.in_flight for r in self.replicas.all() if r.workload_id == workload_id
        ):
            time.sleep(0.05)
        loser = self.store.get_workload(workload_id)
        if loser is not None and loser.state in ACTIVE:
            self.manager.stop(workload_id)
            self.manager.event(workload_id, "rollout", f"stopped: {why}")
        record.retired = time.time()
        self._write(record)

    def _write(self, record: RolloutRecord) -> bool:
        record.updated = time.time()
        if self.cluster is not None:
            written = self.cluster.write(record)
        else:
            self.store.put_rollout(record)
            written = True
        if written:
            with self._lock:
                self._mine[record.rollout_id] = copy.deepcopy(record)
            verdicts = tuple(str(g["verdict"]) for g in record.gates)
            self._written[record.rollout_id] = (time.monotonic(), verdicts)
            self.apply_splits(self.records())
        return written

    def _write_gates(self, record: RolloutRecord, now: float) -> None:
        last, verdicts = self._written.get(record.rollout_id, (0.0, ()))
        changed = verdicts != tuple(str(g["verdict"]) for g in record.gates)
        if changed or time.monotonic() - last >= WRITE_EVERY_S:
            self._write(record)

    def _restart_windows(self, records: list[RolloutRecord]) -> None:
        """After a restart of a lone daemon: the counts of the step in force were lost with
        the process, so its window (and interval) starts again."""
        for record in records:
            if record.state == "PROGRESSING":
                record.window += 1
                record.step_started = time.time()
                if self._write(record):
                    self._events(record, f"rollout {record.rollout_id}: the daemon restarted; "
                                 f"the gates of step {record.step + 1} count again from now")  # fmt: skip

    def _take_requests(self) -> dict[str, str]:
        if self.cluster is not None:
            requests = self.cluster.requests()
            for rollout_id in requests:
                self.cluster.done(rollout_id)
            return requests
        with self._lock:
            requests, self._requests = self._requests, {}
        return requests

    def _events(self, record: RolloutRecord, message: str) -> None:
        for workload_id in (record.workload_id, record.canary_workload_id):
            try:
                self.manager.event(workload_id, "rollout", message)
            except KunlunError as exc:
                print(f"rollout event not written ({exc}): {message}", flush=True)

    # ---- /metrics ----
    def families(self) -> Iterator[Metric]:
        yield from rollout_families(self.records(), self.totals)
