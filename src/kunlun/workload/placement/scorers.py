"""Placement scorers: how the device classes that pass the filters are ranked.

A candidate's rank is ``(Degraded, preferred_device_types order, score)``, smaller first: a
Degraded class only wins when nothing Ready fits, and preferred types come first, in the
spec's order. The score is the spec's ``scorer``:

- ``performance`` (default): the highest declared compute throughput for the workload's
  compute dtype (int8 TOPS for w8a8; :func:`~kunlun.planner.estimate.compute_tokens_per_s`),
  then the highest decode estimate, then the most free memory;
- ``roofline``: the highest decode estimate (:func:`~kunlun.planner.estimate.tokens_per_s`,
  which memory bandwidth usually decides), then the most free memory;
- ``binpack``: the device left with the least free memory that still fits;
- ``spread``: the device with the most free memory.

Within a class the device (or the group of nearest devices by topology distance) with the
most free memory is taken, except under ``binpack``. Each class also has a *bound*, the best
rank any of its candidates could reach, so that the placer can stop once no remaining class
can win.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass
from typing import Any

from kunlun.planner.plan import Demand, Option
from kunlun.workload.ledger import Ledger
from kunlun.workload.pool import DevicePool, nearest_group

SCORERS: tuple[str, ...] = ("performance", "roofline", "binpack", "spread")
#: Scorers that rank by throughput figures known before memory in use.
RATED: frozenset[str] = frozenset({"performance", "roofline"})


@dataclass
class Candidate:
    """The devices of one class the scorer prefers for a demand, and its rank once scored."""

    pool: DevicePool
    option: Option
    group: list[int]
    shares: list[float]
    headroom: float
    rank: tuple[Any, ...] = ()


@dataclass
class Judged:
    """A class that can run a demand: its options and the best rank it could reach."""

    pool: DevicePool
    found: list[Option]
    only: int | None
    bound: tuple[Any, ...]


def class_bound(pool: DevicePool, found: list[Option], demand: Demand) -> tuple[Any, ...]:
    """The best rank a candidate of ``pool`` could reach that does not depend on memory in
    use: Degraded, the preferred-type position, and under a rated scorer its best rates."""
    order = {t: i for i, t in enumerate(demand.preferred_device_types)}
    prefix = (pool.first.degraded, order.get(pool.first.device_type, len(order)))
    if demand.scorer not in RATED:
        return prefix
    return (*prefix, *min(rates(demand.scorer, o) for o in found))


def rates(scorer: str, option: Option) -> tuple[float, ...]:
    """The throughput part of a rated scorer's rank for ``option``, smaller first."""
    decode = -(option.tokens_per_s or 0.0)
    if scorer == "roofline":
        return (decode,)
    return (-(option.compute_tokens_per_s or 0.0), decode)


def free_bound(j: Judged, scorer: str) -> float:
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


def score(scorer: str, c: Candidate) -> tuple[float, ...]:
    """Smaller is better."""
    if scorer == "binpack":
        return (c.headroom, c.option.tp)
    if scorer == "spread":
        return (-c.headroom, c.option.tp)
    return (*rates(scorer, c.option), -c.headroom)


def choose(
    pool: DevicePool, demand: Demand, found: list[Option], only: int | None, ledger: Ledger
) -> Candidate | None:
    """The device (or tp-group) of ``pool`` the scorer prefers for the first option that
    still fits there, or None when every device is taken."""
    weight = demand.priority_weight
    known_topology = pool.first.topology is not None
    for option in found:
        # a group is chosen by topology among 4 x tp devices; without topology, the first
        size = option.num_devices
        limit = 4 * size if size > 1 and known_topology else size
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
            share = ledger.share(pool.caps[i], need.weights_mb, need.min_kv_mb, weight)
            if share is not None:
                group.append(i)
                shares.append(share)
                if len(group) >= limit:
                    break
        if len(group) < size:
            continue
        if size > 1:
            group, shares = nearest_group(pool, group, shares, size)
        headroom = min(ledger.headroom(pool.caps[i]) for i in group)
        return Candidate(pool, option, group, shares, headroom)
    return None
