"""The placer: judge device classes once per kind of demand, rank them, reserve memory.

:class:`Placer` groups devices into classes of identical capacity (see
:attr:`DeviceCapacity.signature`), runs the :mod:`~kunlun.workload.placement.filters` once per
class and kind of demand (cached: the judgement does not depend on memory in use), ranks what
passes with the :mod:`~kunlun.workload.placement.scorers`, and reserves the winner's memory in
its :class:`Ledger` so that the next workload sees it used. :func:`place` is the one-shot
entry point; :func:`demand_of` turns a workload spec into the planner's :class:`Demand`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import cached_property, partial
from typing import Any

import kunlun.workload.placement.reasons as reasons
from kunlun.device.inventory import Inventory
from kunlun.engine.schemes import agrees
from kunlun.engines.measured import Measurement
from kunlun.engines.registry import EngineChoice, choose_plan_engines
from kunlun.errors import ConfigError, Location
from kunlun.planner.capacity import DeviceCapacity, capacity_of, usable_fraction
from kunlun.planner.model_info import ModelInfo
from kunlun.planner.plan import (
    Demand,
    ExecutionPlan,
    Option,
    Rejection,
    build_plan,
    kv_budget_mb,
)
from kunlun.workload.ledger import Ledger, Reservation
from kunlun.workload.placement.filters import explicit_index, judge_class, pools_for
from kunlun.workload.placement.scorers import (
    RATED,
    Candidate,
    Judged,
    choose,
    class_bound,
    free_bound,
    score,
)
from kunlun.workload.pool import DevicePool
from kunlun.workload.spec import WorkloadSpec


@dataclass
class Placement:
    """Where a workload's replicas run, their plans, and why.

    ``alternatives`` (every devices/dtype/tp rejected, with the reason) and ``rejected`` (per
    device class not chosen, why) are worked out when first read, so placing many workloads
    does not format reasons nobody reads.
    """

    groups: list[list[DeviceCapacity]]
    plans: list[ExecutionPlan]
    why: str
    scorer: str
    reservations: list[Reservation] = field(default_factory=list)
    explain: Callable[[], list[Rejection]] = field(default=list, repr=False)
    chosen: frozenset[str] = frozenset()
    engine: EngineChoice | None = None
    """The engine chosen for the replicas and why the others were not (:func:`place`)."""

    @cached_property
    def alternatives(self) -> list[Rejection]:
        return self.explain()

    @cached_property
    def rejected(self) -> dict[str, str]:
        return reasons.by_label([r for r in self.alternatives if r.devices not in self.chosen])

    @property
    def target_device(self) -> str:
        seen = dict.fromkeys(c.device_id for group in self.groups for c in group)
        return ",".join(seen)

    @property
    def dtype(self) -> str:
        return self.plans[0].dtype

    def to_dict(self) -> dict[str, Any]:
        return {
            "target_device": self.target_device,
            "dtype": self.dtype,
            "why": self.why,
            "scorer": self.scorer,
            "rejected": self.rejected,
            "plan": self.plans[0].to_dict(),
            "engine": None if self.engine is None else self.engine.to_dict(),
            "replica_devices": [[c.device_id for c in g] for g in self.groups],
            "reservations": [r.to_dict() for r in self.reservations],
        }


def _rank_key(c: Candidate) -> tuple[Any, ...]:
    return c.rank


class Placer:
    """Places workloads one after another on a fixed set of devices, tracking memory.

    Build it once per inventory; :meth:`place` reserves memory in :attr:`ledger` so the next
    workload sees it used. Class judgements are cached per demand. The capacities' usable
    memory is computed for one ``memory_utilization`` (:func:`capacity_of`): a demand with
    another is refused (:func:`place` builds the capacities for its spec's).
    """

    def __init__(self, capacities: list[DeviceCapacity], ledger: Ledger | None = None,
                 *, starting: bool = False) -> None:  # fmt: skip
        self.ledger = ledger or Ledger()
        self.starting = starting
        self.by_id = {c.device_id: c for c in capacities}
        self.utilizations = {c.utilization for c in capacities}
        classes: dict[tuple[Any, ...], list[DeviceCapacity]] = {}
        for c in capacities:
            classes.setdefault(c.signature, []).append(c)
        self.pools = [DevicePool(caps, self.ledger) for caps in classes.values()]
        self._judged: dict[tuple[Any, ...], tuple[list[Judged], list[Rejection]]] = {}
        self._options: dict[tuple[Any, ...], tuple[list[Option], list[Rejection]]] = {}

    # ---- filters (once per kind of demand) ----
    def _judge_all(self, demand: Demand) -> tuple[list[Judged], list[Rejection]]:
        """Every class judged for ``demand``, ordered by the best rank each could reach, and
        the classes' rejections. Cached: the judgement does not depend on memory in use."""
        key = (demand.model.name, demand.dtype, demand.quantization, demand.max_model_len,
               demand.max_num_seqs, demand.kv_cache_memory_mb, demand.device,
               demand.preferred_device_types, demand.scorer, demand.tp)  # fmt: skip
        cached = self._judged.get(key)
        if cached is not None:
            return cached
        judged: list[Judged] = []
        rejected: list[Rejection] = []
        for pool in pools_for(self.pools, self.by_id, demand):
            only = explicit_index(pool, demand)
            found, refused = self._filter(pool, demand, 1 if only is not None else len(pool.caps))
            rejected.extend(refused)
            if found:
                judged.append(Judged(pool, found, only, class_bound(pool, found, demand)))
        judged.sort(key=lambda j: j.bound)
        self._judged[key] = (judged, rejected)
        return judged, rejected

    def _filter(
        self, pool: DevicePool, demand: Demand, num_devices: int
    ) -> tuple[list[Option], list[Rejection]]:
        """The class's options and rejections for the demand's model and sizes (cached)."""
        key = (id(pool), num_devices, demand.model.name, demand.dtype, demand.quantization,
               demand.max_model_len, demand.max_num_seqs, demand.kv_cache_memory_mb, demand.tp)  # fmt: skip
        cached = self._options.get(key)
        if cached is None:
            cached = self._options[key] = judge_class(
                pool, demand, num_devices, starting=self.starting
            )
        return cached

    # ---- choosing ----
    def place(self, demand: Demand) -> Placement:
        """Place every replica of ``demand`` (reserving memory), or raise ConfigError listing
        every rejected alternative."""
        wanted = usable_fraction(demand.memory_utilization)
        if self.utilizations - {wanted}:
            raise ValueError(
                f"the capacities were measured at memory utilization {sorted(self.utilizations)}"
                f"; the demand plans with {wanted}: build them with capacity_of(profile, "
                f"{demand.memory_utilization})"
            )
        groups: list[list[DeviceCapacity]] = []
        plans: list[ExecutionPlan] = []
        reservations: list[Reservation] = []
        why = ""
        chosen: set[str] = set()
        ranking = reasons.Ranking([], [], [])
        for _ in range(demand.replicas):
            ranking = self._rank(demand)
            if not ranking.candidates:
                detail = "; ".join(f"{r.devices}: {r.reason}" for r in ranking.rejected)
                raise ConfigError(
                    f"no device can run this workload ({detail or 'no device at all'})",
                    location=Location("device"),
                )
            best = ranking.candidates[0]
            group = [best.pool.caps[i] for i in best.group]
            plans.append(self._plan(demand, best, group))
            reservations += self._reserve(demand, best)
            groups.append(group)
            chosen.add(best.pool.label)
            why = why or reasons.why(demand, ranking)
        return Placement(groups, plans, why, demand.scorer, reservations,
                         partial(ranking.explain, demand), frozenset(chosen))  # fmt: skip

    def _rank(self, demand: Demand) -> reasons.Ranking:
        """Candidates best first. Classes are visited in the order of the best rank each could
        reach (for ``performance`` and ``roofline`` its best rates; for ``binpack`` and
        ``spread`` the free memory of its best-placed device); once that bound is worse than
        the best candidate found, the remaining classes cannot win and are skipped."""
        judged, static = self._judge_all(demand)
        if demand.scorer not in RATED:
            judged = sorted(judged, key=lambda j: (*j.bound, free_bound(j, demand.scorer)))
        rejected = list(static)
        candidates: list[Candidate] = []
        best: Candidate | None = None
        for n, j in enumerate(judged):
            if best is not None:
                bound = j.bound if demand.scorer in RATED else (
                    *j.bound, free_bound(j, demand.scorer))  # fmt: skip
                if bound > best.rank[: len(bound)]:
                    return reasons.Ranking(rejected, sorted(candidates, key=_rank_key), judged[n:])
            candidate = choose(j.pool, demand, j.found, j.only, self.ledger)
            if candidate is None:
                first = j.found[0]
                why = reasons.taken(j.pool, demand, first, self.ledger, self.by_id)
                rejected.append(Rejection(j.pool.label, first.dtype, first.tp, why))
                continue
            candidate.rank = (*j.bound[:2], *score(demand.scorer, candidate))
            candidates.append(candidate)
            if best is None or candidate.rank < best.rank:
                best = candidate
        return reasons.Ranking(rejected, sorted(candidates, key=_rank_key), [])

    # ---- committing ----
    def _plan(self, demand: Demand, best: Candidate, group: list[DeviceCapacity]) -> ExecutionPlan:
        share = min(best.shares)
        kv = kv_budget_mb(demand, group[0], best.option.need, share)
        sharers = self.ledger.tenants.get(group[0].device_id, 0)
        note = (f"KV {kv:.0f} MiB per device: its {demand.priority} share (weight "
                f"{demand.priority_weight}, 3:2:1) of the memory left after weights is {share:.0f} MiB; "
                f"{sharers} other workload(s) share the device")  # fmt: skip
        return build_plan(demand, group, best.option, kv, note)

    def _reserve(self, demand: Demand, best: Candidate) -> list[Reservation]:
        out = []
        for i in best.group:
            cap = best.pool.caps[i]
            old = self.ledger.headroom(cap)
            r = Reservation(cap.device_id, best.option.need.weights_mb, best.option.need.min_kv_mb,
                            demand.priority_weight)  # fmt: skip
            self.ledger.add(r)
            best.pool.update(i, old, self.ledger.headroom(cap))
            out.append(r)
        return out


# ---- entry points ----


def demand_of(spec: WorkloadSpec, model: ModelInfo) -> Demand:
    """The planner's view of ``spec``; a spec that contradicts the model is a ConfigError."""
    max_len = spec.max_model_len or model.max_context
    if max_len > model.max_context:
        raise ConfigError(
            f"max_model_len={max_len} is above the model's {model.max_context} "
            "(max_position_embeddings)",
            location=Location("max_model_len"),
        )
    quantization: str = spec.quantization
    checkpoint = model.quantization
    if checkpoint is not None:
        if not agrees(quantization, checkpoint.scheme):
            raise ConfigError(
                f"quantization={quantization}: the checkpoint is already quantized "
                f"({checkpoint.method}, {checkpoint.bits}-bit, {checkpoint.scheme})",
                location=Location("quantization"),
            )
        if checkpoint.scheme == "other":
            raise ConfigError(
                f"the checkpoint's quantization {checkpoint.method!r} is not supported",
                location=Location("quantization"),
            )
        quantization = checkpoint.scheme
    return Demand(
        model=model,
        dtype=spec.dtype,
        quantization=quantization,
        max_model_len=max_len,
        max_num_seqs=spec.max_num_seqs,
        step_tokens=spec.max_num_batched_tokens,
        priority=spec.priority,
        kv_cache_memory_mb=spec.kv_cache_memory_mb,
        device=spec.device,
        preferred_device_types=tuple(spec.preferred_device_types),
        scorer=spec.scorer,
        replicas=spec.replicas,
        engine=spec.engine,  # auto until place() chooses (kunlun.engines.registry)
        tp=spec.tensor_parallel_size,
        memory_utilization=spec.memory_utilization,
    )


def place(
    spec: WorkloadSpec,
    inventory: Inventory,
    model: ModelInfo,
    reservations: list[dict[str, Any]] | None = None,
    *,
    starting: bool = False,
    measured: Sequence[Measurement] = (),
) -> Placement:
    """Devices and plans for ``spec`` on ``inventory`` with memory already reserved by
    ``reservations`` (other workloads' :attr:`Placement.reservations`), or a ConfigError
    saying why nothing fits. ``starting`` adds the runnable-here check; ``measured``: the
    model's measured engine speeds (``engine: auto`` picks by them)."""
    demand = demand_of(spec, model)
    capacities = [capacity_of(p, demand.memory_utilization) for p in inventory.profiles]
    placer = Placer(capacities, Ledger.from_reservations(reservations or []), starting=starting)
    placement = placer.place(demand)
    placement.engine = choose_plan_engines(spec.engine, placement.plans, model, measured)
    return placement
