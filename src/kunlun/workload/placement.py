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
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property, partial
from typing import Any

from kunlun.device.inventory import Inventory
from kunlun.device.profile import Status
from kunlun.errors import ConfigError, Location
from kunlun.planner.capacity import DeviceCapacity, capacity_of
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
from kunlun.workload.ledger import Ledger, Reservation
from kunlun.workload.pool import DevicePool, nearest_group
from kunlun.workload.spec import WorkloadSpec

SCORERS: tuple[str, ...] = ("performance", "binpack", "spread")
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

    @cached_property
    def alternatives(self) -> list[Rejection]:
        return self.explain()

    @cached_property
    def rejected(self) -> dict[str, str]:
        return _by_label([r for r in self.alternatives if r.devices not in self.chosen])

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


@dataclass
class _Candidate:
    pool: DevicePool
    option: Option
    group: list[int]
    shares: list[float]
    headroom: float
    rank: tuple[Any, ...] = ()


@dataclass
class _Judged:
    """A class that can run a demand: its options and the best rank it could reach."""

    pool: DevicePool
    found: list[Option]
    only: int | None
    bound: tuple[Any, ...]


def _rank_key(c: _Candidate) -> tuple[Any, ...]:
    return c.rank


@dataclass
class _Ranking:
    """One placement decision: rejections, candidates best first, classes not evaluated."""

    rejected: list[Rejection]
    candidates: list[_Candidate]
    unranked: list[_Judged]

    def explain(self, demand: Demand) -> list[Rejection]:
        best = self.candidates[0]
        out = list(self.rejected)
        for c in self.candidates[1:]:
            out.append(Rejection(c.pool.label, c.option.dtype, c.option.tp, _lost(demand, best, c)))
        for j in self.unranked:
            out.append(Rejection(j.pool.label, None, None, _skipped(demand, best, j)))
        return out


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
        self.pools = [DevicePool(caps, self.ledger) for caps in classes.values()]
        self._judged: dict[tuple[Any, ...], tuple[list[_Judged], list[Rejection]]] = {}
        self._options: dict[tuple[Any, ...], tuple[list[Option], list[Rejection]]] = {}

    # ---- filters (once per kind of demand) ----
    def _judge_all(self, demand: Demand) -> tuple[list[_Judged], list[Rejection]]:
        """Every class judged for ``demand``, ordered by the best rank each could reach, and
        the classes' rejections. Cached: the judgement does not depend on memory in use."""
        key = (demand.model.name, demand.dtype, demand.quantization, demand.max_model_len,
               demand.batch, demand.kv_cache_memory_mb, demand.device,
               demand.preferred_device_types, demand.scorer)  # fmt: skip
        cached = self._judged.get(key)
        if cached is not None:
            return cached
        order = {t: i for i, t in enumerate(demand.preferred_device_types)}
        judged: list[_Judged] = []
        rejected: list[Rejection] = []
        for pool in self._pools_for(demand):
            only = self._explicit_index(pool, demand)
            found, refused = self._filter(pool, demand, 1 if only is not None else len(pool.caps))
            rejected.extend(refused)
            if found:
                best_rate = max((o.tokens_per_s or 0.0) for o in found)
                prefix = (pool.first.degraded, order.get(pool.first.device_type, len(order)))
                bound = (*prefix, -best_rate) if demand.scorer == "performance" else prefix
                judged.append(_Judged(pool, found, only, bound))
        judged.sort(key=lambda j: j.bound)
        self._judged[key] = (judged, rejected)
        return judged, rejected

    def _filter(
        self, pool: DevicePool, demand: Demand, num_devices: int
    ) -> tuple[list[Option], list[Rejection]]:
        """The class's options and rejections for the demand's model and sizes (cached)."""
        key = (id(pool), num_devices, demand.model.name, demand.dtype, demand.quantization,
               demand.max_model_len, demand.batch, demand.kv_cache_memory_mb)  # fmt: skip
        cached = self._options.get(key)
        if cached is None:
            cached = self._options[key] = self._judge_class(pool, demand, num_devices)
        return cached

    def _judge_class(
        self, pool: DevicePool, demand: Demand, num_devices: int
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
        every rejected alternative."""
        groups: list[list[DeviceCapacity]] = []
        plans: list[ExecutionPlan] = []
        reservations: list[Reservation] = []
        why = ""
        chosen: set[str] = set()
        ranking = _Ranking([], [], [])
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
            why = why or _why(demand, best, len(ranking.candidates) + len(ranking.unranked))
        return Placement(groups, plans, why, demand.scorer, reservations,
                         partial(ranking.explain, demand), frozenset(chosen))  # fmt: skip

    def _rank(self, demand: Demand) -> _Ranking:
        """Candidates best first. Classes are visited in the order of the best rank each could
        reach (for ``performance`` its best estimate; for ``binpack`` and ``spread`` the free
        memory of its best-placed device); once that bound is worse than the best candidate
        found, the remaining classes cannot win and are skipped."""
        judged, static = self._judge_all(demand)
        if demand.scorer != "performance":
            judged = sorted(judged, key=lambda j: (*j.bound, self._free_bound(j, demand.scorer)))
        rejected = list(static)
        candidates: list[_Candidate] = []
        best: _Candidate | None = None
        for n, j in enumerate(judged):
            if best is not None:
                bound = j.bound if demand.scorer == "performance" else (
                    *j.bound, self._free_bound(j, demand.scorer))  # fmt: skip
                if bound > best.rank[: len(bound)]:
                    return _Ranking(rejected, sorted(candidates, key=_rank_key), judged[n:])
            candidate = self._candidate(j.pool, demand, j.found, j.only)
            if candidate is None:
                why = self._full(j.pool, demand, j.found[0])
                rejected.append(Rejection(j.pool.label, j.found[0].dtype, j.found[0].tp, why))
                continue
            candidate.rank = (*j.bound[:2], *_score(demand.scorer, candidate))
            candidates.append(candidate)
            if best is None or candidate.rank < best.rank:
                best = candidate
        return _Ranking(rejected, sorted(candidates, key=_rank_key), [])

    @staticmethod
    def _free_bound(j: _Judged, scorer: str) -> float:
        """The best score a class's candidate could have: ``spread``, minus the most free
        memory of its devices; ``binpack``, the least free memory that could still hold the
        smallest per-device need of its options."""
        ordered = j.pool.sorted
        if j.only is not None:
            free = next(h for h, i in ordered if i == j.only)
            return -free if scorer == "spread" else free
        if scorer == "spread":
            return -ordered[-1][0]
        smallest = min(o.need.weights_mb + o.need.min_kv_mb for o in j.found)
        pos = bisect.bisect_left(ordered, (smallest, -1))
        return ordered[pos][0] if pos < len(ordered) else math.inf

    def _pools_for(self, demand: Demand) -> list[DevicePool]:
        if demand.device is None:
            return self.pools
        if demand.device not in self.by_id:
            known = ", ".join(self.by_id)
            raise ConfigError(f"device {demand.device!r} does not exist; devices: {known}",
                              location=Location("device"))  # fmt: skip
        return [p for p in self.pools if any(c.device_id == demand.device for c in p.caps)]

    @staticmethod
    def _explicit_index(pool: DevicePool, demand: Demand) -> int | None:
        if demand.device is None:
            return None
        return next(i for i, c in enumerate(pool.caps) if c.device_id == demand.device)

    def _candidate(
        self, pool: DevicePool, demand: Demand, found: list[Option], only: int | None
    ) -> _Candidate | None:
        """The device (or tp-group) of ``pool`` the scorer prefers for the first option that
        still fits there, or None when every device is taken."""
        weight = demand.priority_weight
        known_topology = pool.first.topology is not None
        for option in found:
            # a group is chosen by topology among 4 x tp devices; without topology, the first
            limit = 4 * option.tp if option.tp > 1 and known_topology else option.tp
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
                    if len(group) >= limit:
                        break
            if len(group) < option.tp:
                continue
            if option.tp > 1:
                group, shares = nearest_group(pool, group, shares, option.tp)
            headroom = min(self.ledger.headroom(pool.caps[i]) for i in group)
            return _Candidate(pool, option, group, shares, headroom)
        return None

    def _full(self, pool: DevicePool, demand: Demand, option: Option) -> str:
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
        note = (f"KV {kv:.0f} MiB per device: its {demand.priority} share (weight "
                f"{demand.priority_weight}, 3:2:1) of the memory left after weights is {share:.0f} MiB; "
                f"{sharers} other workload(s) share the device")  # fmt: skip
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
        "no estimate (no compute or bandwidth declared)"
        if rate is None
        else f"estimated {rate:.0f} tokens/s"
    )


def _why(demand: Demand, best: _Candidate, num_candidates: int) -> str:
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
        parts.append(f"performance: {_rate(best)}")
    else:
        parts.append(f"{demand.scorer}: {best.headroom:.0f} MiB free before placing")
    if num_candidates > 1:
        parts.append(f"{num_candidates - 1} other candidate class(es) ranked lower")
    return "; ".join(parts)


def _lost(demand: Demand, winner: _Candidate, loser: _Candidate) -> str:
    if winner.rank[0] != loser.rank[0]:
        return "Degraded; a Ready device fits"
    if winner.rank[1] != loser.rank[1]:
        return f"not earlier in preferred_device_types {list(demand.preferred_device_types)}"
    if demand.scorer == "performance":
        return f"ranked lower by performance: {_rate(loser)} vs {_rate(winner)}"
    return (
        f"ranked lower by {demand.scorer}: {loser.headroom:.0f} MiB free vs {winner.headroom:.0f}"
    )


def _skipped(demand: Demand, best: _Candidate, j: _Judged) -> str:
    """Why a class that was not evaluated could not have won."""
    if j.bound[0] != best.rank[0]:
        return "Degraded; a Ready device fits"
    if j.bound[1] != best.rank[1]:
        return f"not earlier in preferred_device_types {list(demand.preferred_device_types)}"
    if demand.scorer == "performance":
        return (f"ranked lower by performance: estimated at most {-j.bound[2]:.0f} tokens/s vs "
                f"{_rate(best)}")  # fmt: skip
    return f"ranked lower by {demand.scorer}: {best.headroom:.0f} MiB free on the chosen device"


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
    quantization: str = spec.quantization
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
