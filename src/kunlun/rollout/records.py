"""What the rollout controller reads off rollout records, without side effects.

The states in which a rollout still runs (:data:`RUNNING_STATES`); the refusals of a
new rollout (:func:`refuse_start`: a baseline that is not serving, a model with a rollout
already running, overrides of the model or its name); the canary's share now
(:func:`canary_weight`) and in the gateway's split (:func:`split_weight`, which also holds
after the rollout ended until the losing version is gone); a finished step's entry of the
history (:func:`finished_step`); and the wording of failed gates with the cause a rollback
is counted under in ``/metrics`` (:func:`failed`, :func:`reason_kind`). Kept apart from
:class:`~kunlun.rollout.controller.RolloutController`, which acts on them.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

from kunlun.errors import ConfigError, Location
from kunlun.rollout.gates import GateResult
from kunlun.rollout.spec import RolloutSpec
from kunlun.state.store import RolloutRecord, WorkloadRecord
from kunlun.workload.manager import ACTIVE

RUNNING_STATES = ("STARTING", "PROGRESSING")


def refuse_start(
    baseline: WorkloadRecord, spec: RolloutSpec, records: Callable[[], list[RolloutRecord]]
) -> None:
    """Raise the :class:`ConfigError` that refuses ``spec`` for ``baseline``, if any:
    the workload is not running, already has a rollout (``records`` is read only once the
    workload is found serving), or the overrides name the model or its name."""
    if baseline.state not in ACTIVE:
        raise ConfigError(
            f"workload {baseline.workload_id} ({baseline.name}) is {baseline.state}: only a "
            "serving workload can be rolled out",
            location=Location("request", field="workload"),
        )
    for other in records():
        if other.state in RUNNING_STATES and baseline.workload_id in (
            other.workload_id,
            other.canary_workload_id,
        ):
            doing = (
                "in progress"
                if other.state in RUNNING_STATES
                else "still stopping "
                + (other.canary_workload_id if other.state != "PROMOTED" else other.workload_id)
            )
            raise ConfigError(
                f"model {baseline.name!r} already has a rollout {doing} "
                f"({other.rollout_id}, {other.state})",
                location=Location("request", field="workload"),
                hint=f"kunlun-cli rollout abort {other.rollout_id} or promote it first",
            )
    if "name" in spec.overrides or "model" in spec.overrides:
        field_name = "name" if "name" in spec.overrides else "model"
        raise ConfigError(
            f"overrides.{field_name}: the canary serves the baseline's model name and "
            "takes its model from --model",
            location=Location("request", field=f"overrides.{field_name}"),
        )


def canary_weight(record: RolloutRecord) -> float:
    """The canary's percentage of its model's requests now."""
    if record.state == "PROGRESSING":
        return record.steps[record.step]
    return 100.0 if record.state == "PROMOTED" else 0.0


def split_weight(record: RolloutRecord, present: set[str]) -> float | None:
    """The canary's percentage in the gateway's split (``present``: the workloads with
    replicas), or None when the model needs no split: the step's weight while the rollout
    progresses, 0 while the canary starts, and after the end 0 or 100 until the losing
    version's replicas are gone."""
    if record.state == "PROGRESSING":
        return record.steps[record.step]
    if record.state == "STARTING":
        return 0.0  # its replicas must not take requests before the first step
    if record.state in ("ROLLED_BACK", "ABORTED") and record.canary_workload_id in present:
        return 0.0
    if record.state == "PROMOTED" and record.workload_id in present:
        return 100.0
    return None


def finished_step(record: RolloutRecord, now: float) -> dict[str, Any]:
    """The history entry of the step in force, ending ``now``."""
    return {"step": record.step, "window": record.window, "weight": record.steps[record.step],
            "started": record.step_started, "ended": now, "gates": record.gates}  # fmt: skip


def newer(found: RolloutRecord, mine: RolloutRecord | None) -> RolloutRecord:
    """``found`` (from the store), or a copy of ``mine`` (this node's last write) when that
    is more recent."""
    if mine is not None and mine.updated > found.updated:
        return copy.deepcopy(mine)
    return found


def failed(gates: list[GateResult]) -> str:
    """Why ``gates`` failed, in one line."""
    return "; ".join(f"gate {g.gate} failed: {g.detail}" for g in gates)


def reason_kind(why: str) -> str:
    """The cause a rollback of reason ``why`` is counted under: the gate, else ``start``."""
    for gate in ("error_rate", "p95_ttft", "p95_e2e"):
        if f"gate {gate} failed" in why:
            return gate
    return "start"


def steps_text(steps: list[float]) -> str:
    """``10,50,100``."""
    return ",".join(f"{s:g}" for s in steps)
