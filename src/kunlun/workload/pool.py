"""Device classes for placement: identical devices kept sorted by free memory, and the
choice of the nearest tensor-parallel group by topology distance."""

from __future__ import annotations

import bisect
import itertools
import math

from kunlun.planner.capacity import DeviceCapacity, distance
from kunlun.workload.ledger import Ledger

#: Above this many combinations, a group is built around each device's nearest neighbours.
MAX_COMBINATIONS = 5000


class DevicePool:
    """One device class: identical devices, kept sorted by headroom."""

    def __init__(self, caps: list[DeviceCapacity], ledger: Ledger) -> None:
        self.caps = caps
        self.first = max(caps, key=lambda c: c.usable_mb)  # the class's best case
        self.label = label(caps)
        self.sorted = sorted((ledger.headroom(c), i) for i, c in enumerate(caps))

    def update(self, i: int, old: float, new: float) -> None:
        del self.sorted[bisect.bisect_left(self.sorted, (old, i))]
        bisect.insort(self.sorted, (new, i))


def nearest_group(
    pool: DevicePool, group: list[int], shares: list[float], tp: int
) -> tuple[list[int], list[float]]:
    """The ``tp`` devices among ``group`` closest to each other (the smallest largest pairwise
    topology distance, then the smallest sum; every combination when there are few, else each
    device's nearest neighbours), in device order."""
    if math.comb(len(group), tp) <= MAX_COMBINATIONS:
        choices: list[tuple[int, ...]] = list(itertools.combinations(group, tp))
    else:
        choices = [_neighbours(pool, seed, group, tp) for seed in group]
    best = min(choices, key=lambda members: _cost(pool, members))
    chosen = sorted(best, key=lambda i: pool.caps[i].index)
    return chosen, [shares[group.index(i)] for i in chosen]


def _neighbours(pool: DevicePool, seed: int, group: list[int], tp: int) -> tuple[int, ...]:
    return tuple(sorted(group, key=lambda j: _dist(pool, seed, j))[:tp])


def _cost(pool: DevicePool, members: tuple[int, ...]) -> tuple[float, float]:
    pairs = [_dist(pool, a, b) for a, b in itertools.combinations(members, 2)]
    return (max(pairs), sum(pairs))


def _dist(pool: DevicePool, a: int, b: int) -> float:
    d = distance(pool.caps[a], pool.caps[b])
    return 0.0 if a == b else float(d) if d is not None else 0.0


def label(caps: list[DeviceCapacity]) -> str:
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
