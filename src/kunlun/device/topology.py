"""Checking a declared topology matrix, with safe degradation instead of failure.

Each declared device gives its own row of distances (``topology_distance``); the rows of the N
declared devices of one type, ordered by ``device_id``, form the N x N matrix. A matrix of the
wrong shape or an inconsistent one is not a config error: the leading devices whose rows form
a consistent square matrix (zero diagonal, symmetric) stay usable, the rest are Excluded
("safe degradation mode").
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TopologyVerdict:
    """How many leading devices form a consistent matrix, and why the next one does not."""

    num_devices: int
    num_consistent: int
    problem: str | None  # why device ``num_consistent`` broke the matrix; None if all fit

    @property
    def complete(self) -> bool:
        return self.num_consistent == self.num_devices


def check_matrix(rows: list[list[int] | None]) -> TopologyVerdict:
    """The largest k such that rows[0..k) give a consistent k x k matrix."""
    n = len(rows)
    for k in range(n):
        problem = _breaks(rows, k, n)
        if problem is not None:
            return TopologyVerdict(n, k, problem)
    return TopologyVerdict(n, n, None)


def _breaks(rows: list[list[int] | None], k: int, n: int) -> str | None:
    """Why adding device ``k`` to the consistent k x k matrix fails, or None."""
    row = rows[k]
    if row is None:
        return "has no topology_distance row"
    if len(row) != n and len(row) <= k:
        return f"its row has {len(row)} entries for {n} devices"
    if row[k] != 0:
        return f"its distance to itself is {row[k]}, not 0"
    for j in range(k):
        other = rows[j]
        assert other is not None
        if len(other) <= k:
            return f"device {j}'s row has {len(other)} entries, none for device {k}"
        if other[k] != row[j]:
            return f"distance {j}->{k} is {other[k]} but {k}->{j} is {row[j]} (not symmetric)"
    return None
