"""Choosing devices for a workload, with the reason for every alternative rejected.

Placement works on device *classes*: devices of one type with identical capacity (see
:attr:`DeviceCapacity.signature`). Each class is judged once per workload by filters that
return reasons (``(kept, rejected)``):

1. health: Unhealthy and Excluded devices are rejected with their profile's reasons;
2. explicit device: only that device's class, with only that device;
3. dtype and quantization support: the spec's dtype, or the preference order of
   :func:`kunlun.planner.plan.dtype_order`; ``w8a8`` needs ``int8`` in ``supported_dtypes``;
4. memory fit, including KV for one sequence of ``max_model_len``, at the smallest
   tensor-parallel size that fits (groups need ``p2p_enabled``; heads must divide);
5. runnable here (the torch backend imports; the embedded engine runs one unquantized
   device per replica), only when the workload is actually starting, not for a plan or dry run.

Classes that pass are ranked by ``(Degraded, preferred_device_types order, score)``: a Degraded
class only wins when nothing Ready fits, and preferred types come first, in the spec's order.
Scorers (``spec.scorer``): ``performance`` (default: the highest estimated decode tokens/s,
:mod:`kunlun.planner.estimate`), ``binpack`` (the device left with the least free memory) and
``spread`` (the device with the most free memory). Within a class the device (or the group of
nearest devices by topology distance) with the most free memory is taken, except under
``binpack``.

Memory is tracked in a :class:`Ledger`: weights are reserved whole, while the workloads that
share a device split the memory left after all their weights by priority, 3:2:1 for
high:normal:low; a workload fits only when every sharer's split still holds one full-length
sequence of KV.
"""

from __future__ import annotations

import bisect
import importlib.util
import itertools
import math
from dataclasses import dataclass, field
from typing import Any

from kunlun.device.inventory import Inventory
from kunlun.device.profile import Status
from kunlun.errors import ConfigError, Location
from kunlun.planner.capacity import DeviceCapacity, capacity_of, distance
from kunlun.planner.model_info import ModelInfo
from kunlun.planner.plan import (
    Demand,
    ExecutionPlan,
    Option,
    Rejection,
    build_plan,
    kv_budget_mb,
    options,
)
from kunlun.workload.spec import WorkloadSpec

SCORERS: tuple[str, ...] = ("performance", "binpack", "spread")
_MAX_COMBINATIONS = 5000
_EXTENSIONS = {"npu": "torch_npu", "mlu": "torch_mlu", "musa": "torch_musa", "gcu": "torch_gcu"}


def runnable(device: DeviceCapacity) -> str | None:
    """None when the embedded engine's torch backend for ``device`` imports here, else why not."""
    kind = device.torch_device_type
    if kind == "cpu":
        return None
    module = _EXTENSIONS.get(kind, "torch")
    if importlib.util.find_spec(module) is None:
        return f"the torch backend for {kind} ({module}) is not installed here"
    return None


@dataclass
class Reservation:
    """Memory one replica holds on one device (MiB), and its priority weight."""

    device: str
    weights_mb: float
    min_kv_mb: float
    priority_weight: int

    def to_dict(self) -> dict[str, Any]:
        return {"device": self.device, "weights_mb": round(self.weights_mb, 1),
                "min_kv_mb": round(self.min_kv_mb, 1), "priority_weight": self.priority_weight}  # fmt: skip


class Ledger:
    """Memory promised to workloads on each device: weights, and priority-weighted KV."""

    def __init__(self) -> None:
        self.weights: dict[str, float] = {}
        self.priority: dict[str, int] = {}
        self.kv_per_weight: dict[str, float] = {}  # max over sharers of min_kv / priority
        self.tenants: dict[str, int] = {}

    @classmethod
    def from_reservations(cls, reservations: list[dict[str, Any]]) -> Ledger:
        ledger = cls()
        for r in reservations:
            ledger.add(
                Reservation(r["device"], r["weights_mb"], r["min_kv_mb"], r["priority_weight"])
            )
        return ledger

    def add(self, r: Reservation) -> None:
        d = r.device
        self.weights[d] = self.weights.get(d, 0.0) + r.weights_mb
        self.priority[d] = self.priority.get(d, 0) + r.priority_weight
        ratio = r.min_kv_mb / r.priority_weight
        self.kv_per_weight[d] = max(self.kv_per_weight.get(d, 0.0), ratio)
        self.tenants[d] = self.tenants.get(d, 0) + 1

    def headroom(self, cap: DeviceCapacity) -> float:
        """Memory not promised to weights."""
        return cap.usable_mb - self.weights.get(cap.device_id, 0.0)

    def share(
        self, cap: DeviceCapacity, weights_mb: float, min_kv_mb: float, weight: int
    ) -> float | None:
        """The KV share a new sharer with ``weight`` would get on ``cap``, or None when it or
        a sharer already there would be left less than its one full-length sequence."""
        d = cap.device_id
        free = cap.usable_mb - self.weights.get(d, 0.0) - weights_mb
        total = self.priority.get(d, 0) + weight
        per_weight = free / total
        if per_weight < min_kv_mb / weight or per_weight < self.kv_per_weight.get(d, 0.0):
            return None
        return per_weight * weight


@dataclass
class Placement:
    """Where a workload's replicas run, their plans, and why."""

    groups: list[list[DeviceCapacity]]
    plans: list[ExecutionPlan]
    why: str
    scorer: str
    rejected: dict[str, str] = field(default_factory=dict)
    alternatives: list[Rejection] = field(default_factory=list)
    reservations: list[Reservation] = field(default_factory=list)

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
            "replica_devices": [[c.device_id for c in g] for g in self.groups],
            "reservations": [r.to_dict() for r in self.reservations],
        }


class _Pool:
    """One device class: identical devices, kept sorted by headroom."""

    def __init__(self, caps: list[DeviceCapacity], ledger: Ledger) -> None:
        self.caps = caps
        self.first = max(caps, key=lambda c: c.usable_mb)  # the class's best case
        self.label = _label(caps)
        self.sorted = sorted((ledger.headroom(c), i) for i, c in enumerate(caps))

    def update(self, i: int, old: float, new: float) -> None:
        del self.sorted[bisect.bisect_left(self.sorted, (old, i))]
        bisect.insort(self.sorted, (new, i))


@dataclass
class _Candidate:
    pool: _Pool
    option: Option
    group: list[int]
    shares: list[float]
    headroom: float
    rank: tuple[Any, ...] = ()


class Placer:
    """Places workloads one after another on a fixed set of devices, tracking memory.

    Build it once per inventory; :meth:`place` reserves memory in :attr:`ledger` so the next
    workload sees it used. Class judgements are cached per demand.
    """

    def __init__(self, capacities: list[DeviceCapacity], ledger: Ledger | None = None,
                 *, starting: bool = False) -> None:  # fmt: skip
        self.ledger = ledger or Ledger()
        self.starting = starting
        self.by_id = {c.device_id: c for c in capacities}
        classes: dict[tuple[Any, ...], list[DeviceCapacity]] = {}
        for c in capacities:
            classes.setdefault(c.signature, []).append(c)
        self.pools = [_Pool(caps, self.ledger) for caps in classes.values()]
        self._judged: dict[tuple[Any, ...], tuple[list[Option], list[Rejection]]] = {}

    # ---- filters ----
    def _judge(
        self, pool: _Pool, demand: Demand, num_devices: int
    ) -> tuple[list[Option], list[Rejection]]:
        key = (id(pool), num_devices, demand.model.name, demand.dtype, demand.quantization,
               demand.max_model_len, demand.batch, demand.kv_cache_memory_mb)  # fmt: skip
        judged = self._judged.get(key)
        if judged is None:
            judged = self._filter(pool, demand, num_devices)
            self._judged[key] = judged
        return judged

    def _filter(
        self, pool: _Pool, demand: Demand, num_devices: int
    ) -> tuple[list[Option], list[Rejection]]:
        cap, label = pool.first, pool.label
        if cap.status not in (Status.READY, Status.DEGRADED):
            why = "; ".join(cap.reasons) or "no reason given"
            return [], [Rejection(label, None, None, f"status {cap.status.value}: {why}")]
        found, rejected = options(demand, cap, num_devices, label)
        if self.starting and found:
            found, refused = _runnable_options(cap, demand, found, label)
            rejected += refused
        return found, rejected

    # ---- choosing ----
    def place(self, demand: Demand) -> Placement:
        """Place every replica of ``demand`` (reserving memory), or raise ConfigError listing
        every rejected alternative.

        The placement's ``rejected`` names, per device class not chosen, why; its
        ``alternatives`` hold every (devices, dtype, tp) rejected, the chosen class's too.
        """
        groups: list[list[DeviceCapacity]] = []
        plans: list[ExecutionPlan] = []
        reservations: list[Reservation] = []
        why = ""
        rejected: list[Rejection] = []
        chosen: set[str] = set()
        for _ in range(demand.replicas):
            best, rejected, ranked = self._best(demand)
            if best is None:
                detail = (
                    "; ".join(f"{r.devices}: {r.reason}" for r in rejected) or "no device at all"
                )
                raise ConfigError(
                    f"no device can run this workload ({detail})", location=Location("device")
                )
            group = [best.pool.caps[i] for i in best.group]
            plans.append(self._plan(demand, best, group))
            reservations += self._reserve(demand, best)
            groups.append(group)
            chosen.add(best.pool.label)
            why = why or _why(demand, best, ranked)
        others = [r for r in rejected if r.devices not in chosen]
        return Placement(
            groups, plans, why, demand.scorer, _by_label(others), rejected, reservations
        )

    def _best(self, demand: Demand) -> tuple[_Candidate | None, list[Rejection], list[_Candidate]]:
        rejected: list[Rejection] = []
        candidates: list[_Candidate] = []
        order = {t: i for i, t in enumerate(demand.preferred_device_types)}
        for pool in self._pools_for(demand):
            only = self._explicit_index(pool, demand)
            found, refused = self._judge(pool, demand, 1 if only is not None else len(pool.caps))
            rejected += refused
            if not found:
                continue
            candidate = self._candidate(pool, demand, found, only)
            if candidate is None:
                rejected.append(
                    Rejection(
                        pool.label, found[0].dtype, found[0].tp, self._full(pool, demand, found[0])
                    )
                )
                continue
            candidate.rank = (pool.first.degraded, order.get(pool.first.device_type, len(order)),
                              *_score(demand.scorer, candidate))  # fmt: skip
            candidates.append(candidate)
        candidates.sort(key=lambda c: c.rank)
        for loser in candidates[1:]:
            rejected.append(Rejection(loser.pool.label, loser.option.dtype, loser.option.tp,
                                      _lost(demand, candidates[0], loser)))  # fmt: skip
        return (candidates[0] if candidates else None), rejected, candidates

    def _pools_for(self, demand: Demand) -> list[_Pool]:
        if demand.device is None:
            return self.pools
        if demand.device not in self.by_id:
            known = ", ".join(self.by_id)
            raise ConfigError(f"device {demand.device!r} does not exist; devices: {known}",
                              location=Location("device"))  # fmt: skip
        return [p for p in self.pools if any(c.device_id == demand.device for c in p.caps)]

    @staticmethod
    def _explicit_index(pool: _Pool, demand: Demand) -> int | None:
        if demand.device is None:
            return None
        return next(i for i, c in enumerate(pool.caps) if c.device_id == demand.device)

    def _candidate(
        self, pool: _Pool, demand: Demand, found: list[Option], only: int | None
    ) -> _Candidate | None:
        """The device (or tp-group) of ``pool`` the scorer prefers for the first option that
        still fits there, or None when every device is taken."""
        weight = demand.priority_weight
        for option in found:
            need = option.need
            if only is not None:
                positions: range | list[int] = [only]
            elif demand.scorer == "binpack":
                low = (need.weights_mb + need.min_kv_mb, -1)
                positions = range(bisect.bisect_left(pool.sorted, low), len(pool.sorted))
            else:
                positions = range(len(pool.sorted) - 1, -1, -1)
            group: list[int] = []
            shares: list[float] = []
            for pos in positions:
                i = pos if only is not None else pool.sorted[pos][1]
                share = self.ledger.share(pool.caps[i], need.weights_mb, need.min_kv_mb, weight)
                if share is not None:
                    group.append(i)
                    shares.append(share)
                    if len(group) >= (1 if option.tp == 1 else 4 * option.tp):
                        break
            if len(group) < option.tp:
                continue
            if option.tp > 1:
                group, shares = _nearest(pool, group, shares, option.tp)
            headroom = min(self.ledger.headroom(pool.caps[i]) for i in group)
            return _Candidate(pool, option, group, shares, headroom)
        return None

    def _full(self, pool: _Pool, demand: Demand, option: Option) -> str:
        need = option.need.weights_mb + option.need.min_kv_mb
        what = f"{option.dtype} tp={option.tp} needs {need:.0f} MiB for weights + KV"
        if demand.device is not None:
            free = self.ledger.headroom(self.by_id[demand.device])
            return f"{demand.device} is taken: {what} at its {demand.priority} share; {free:.0f} MiB free"
        most = pool.sorted[-1][0]
        return f"every device is taken: {what} at its {demand.priority} share; most free {most:.0f} MiB"

    # ---- committing ----
    def _plan(self, demand: Demand, best: _Candidate, group: list[DeviceCapacity]) -> ExecutionPlan:
        share = min(best.shares)
        kv = kv_budget_mb(demand, group[0], best.option.need, share)
        sharers = self.ledger.tenants.get(group[0].device_id, 0)
        note = (f"KV: {kv:.0f} MiB per device, the {demand.priority} ({demand.priority_weight}) share "
                f"of memory left after weights, shared with {sharers} other workload(s) (3:2:1)")  # fmt: skip
        return build_plan(demand, group, best.option, kv, note)

    def _reserve(self, demand: Demand, best: _Candidate) -> list[Reservation]:
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


def _runnable_options(
    cap: DeviceCapacity, demand: Demand, found: list[Option], label: str
) -> tuple[list[Option], list[Rejection]]:
    """Only what the embedded engine can start here: backend importable, one device, no
    weight quantization."""
    if (why := runnable(cap)) is not None:
        return [], [Rejection(label, None, None, why)]
    if demand.quantization != "none":
        return [], [Rejection(label, None, None, f"the embedded engine does not run "
                              f"quantization={demand.quantization} weights yet")]  # fmt: skip
    kept = [o for o in found if o.tp == 1]
    refused = [Rejection(label, o.dtype, o.tp, "the embedded engine runs one device per replica")
               for o in found if o.tp > 1]  # fmt: skip
    return kept, refused


def _nearest(
    pool: _Pool, group: list[int], shares: list[float], tp: int
) -> tuple[list[int], list[float]]:
    """The ``tp`` devices among ``group`` closest to each other: the smallest largest pairwise
    topology distance, then the smallest sum (every combination when there are few, else
    each device's nearest neighbours)."""
    if math.comb(len(group), tp) <= _MAX_COMBINATIONS:
        choices: list[tuple[int, ...]] = list(itertools.combinations(group, tp))
    else:
        choices = [
            tuple(sorted(group, key=lambda j, s=seed: _dist(pool, s, j))[:tp]) for seed in group
        ]
    chosen = min(choices, key=lambda c: _cost(pool, c))
    return list(chosen), [shares[group.index(i)] for i in chosen]


def _cost(pool: _Pool, members: tuple[int, ...]) -> tuple[float, float]:
    pairs = [_dist(pool, a, b) for a, b in itertools.combinations(members, 2)]
    return (max(pairs), sum(pairs))


def _dist(pool: _Pool, a: int, b: int) -> float:
    d = distance(pool.caps[a], pool.caps[b])
    return 0.0 if a == b else float(d) if d is not None else 0.0


def _score(scorer: str, c: _Candidate) -> tuple[float, ...]:
    """Smaller is better."""
    if scorer == "binpack":
        return (c.headroom, c.option.tp)
    if scorer == "spread":
        return (-c.headroom, c.option.tp)
    rate = c.option.tokens_per_s
    return (-(rate or 0.0), -c.headroom)


def _rate(c: _Candidate) -> str:
    rate = c.option.tokens_per_s
    return (
        "no estimate (no compute or bandwidth declared)" if rate is None else f"{rate:.0f} tokens/s"
    )


def _why(demand: Demand, best: _Candidate, ranked: list[_Candidate]) -> str:
    pool, option = best.pool, best.option
    chose = f"{', '.join(pool.caps[i].device_id for i in best.group)} ({option.dtype}"
    chose += f", {demand.quantization}" if demand.quantization != "none" else ""
    chose += f", tp={option.tp})"
    if demand.device:
        return f"explicit device {demand.device}: {chose}"
    parts = [chose]
    if pool.first.device_type in demand.preferred_device_types:
        parts.append(f"preferred device type {pool.first.device_type}")
    if pool.first.degraded:
        parts.append("Degraded, but nothing Ready fits")
    if demand.scorer == "performance":
        parts.append(f"performance: estimated {_rate(best)}")
    else:
        parts.append(f"{demand.scorer}: {best.headroom:.0f} MiB free before placing")
    if len(ranked) > 1:
        parts.append(f"{len(ranked) - 1} other candidate class(es) ranked lower")
    return "; ".join(parts)


def _lost(demand: Demand, winner: _Candidate, loser: _Candidate) -> str:
    if winner.rank[0] != loser.rank[0]:
        return "Degraded; a Ready device fits"
    if winner.rank[1] != loser.rank[1]:
        return f"not earlier in preferred_device_types {list(demand.preferred_device_types)}"
    if demand.scorer == "performance":
        return f"ranked lower by performance: estimated {_rate(loser)} vs {_rate(winner)}"
    return (
        f"ranked lower by {demand.scorer}: {loser.headroom:.0f} MiB free vs {winner.headroom:.0f}"
    )


def _label(caps: list[DeviceCapacity]) -> str:
    """``ascend:0-3`` for a class of devices 0..3, ``nvidia:0`` for one."""
    indices = sorted(c.index for c in caps)
    runs: list[str] = []
    start = prev = indices[0]
    for i in [*indices[1:], None]:
        if i is not None and i == prev + 1:
            prev = i
            continue
        runs.append(str(start) if start == prev else f"{start}-{prev}")
        if i is not None:
            start = prev = i
    return f"{caps[0].device_type}:{','.join(runs)}"


def _by_label(rejected: list[Rejection]) -> dict[str, str]:
    out: dict[str, str] = {}
    for r in rejected:
        what = " ".join(x for x in (r.dtype, f"tp={r.tp}" if r.tp else None) if x)
        line = f"{what}: {r.reason}" if what else r.reason
        out[r.devices] = f"{out[r.devices]}; {line}" if r.devices in out else line
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
    quantization = spec.quantization
    checkpoint = model.quantization
    if checkpoint is not None:
        if quantization not in ("none", checkpoint.scheme):
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
        batch=spec.batch_size,
        priority=spec.priority,
        kv_cache_memory_mb=spec.kv_cache_memory_mb,
        device=spec.device,
        preferred_device_types=tuple(spec.preferred_device_types),
        scorer=spec.scorer,
        replicas=spec.replicas,
        engine=spec.engine,
    )


def place(
    spec: WorkloadSpec,
    inventory: Inventory,
    model: ModelInfo,
    reservations: list[dict[str, Any]] | None = None,
    *,
    starting: bool = False,
) -> Placement:
    """Devices and plans for ``spec`` on ``inventory`` with memory already reserved by
    ``reservations`` (other workloads' :attr:`Placement.reservations`), or a ConfigError
    saying why nothing fits. ``starting`` adds the runnable-here check."""
    capacities = [capacity_of(p) for p in inventory.profiles]
    placer = Placer(capacities, Ledger.from_reservations(reservations or []), starting=starting)
    return placer.place(demand_of(spec, model))
