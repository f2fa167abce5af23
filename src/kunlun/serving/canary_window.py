"""What the gateway counts of each version during a rollout step: requests, errors, and the
time to first token and end-to-end latency as histograms.

A :class:`LatencyHistogram` has logarithmic buckets 1 % wide (from 0.1 ms up), kept sparse,
so its quantiles are within 1 % of the true ones and two of them add up exactly: every
cluster node counts its own requests and the leader merges them (:meth:`merge`) before the
gates decide. :class:`RolloutStats` holds one :class:`VersionWindow` per rollout, step and
role (``baseline``, ``canary``) and gate window; a request is counted in the window it was
admitted in.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

BASELINE, CANARY = "baseline", "canary"
ROLES = (BASELINE, CANARY)
_RATIO = 1.01
_LOG_RATIO = math.log(_RATIO)
_FLOOR_MS = 0.1


@dataclass
class LatencyHistogram:
    """Milliseconds in buckets ``[0.1 * 1.01**i, 0.1 * 1.01**(i+1))``."""

    counts: dict[int, int] = field(default_factory=dict)
    total: int = 0

    def add(self, ms: float) -> None:
        index = 0 if ms <= _FLOOR_MS else int(math.log(ms / _FLOOR_MS) / _LOG_RATIO)
        self.counts[index] = self.counts.get(index, 0) + 1
        self.total += 1

    def merge(self, other: LatencyHistogram) -> None:
        for index, count in other.counts.items():
            self.counts[index] = self.counts.get(index, 0) + count
        self.total += other.total

    def at_rank(self, rank: int) -> float:
        """The value of the ``rank``-th smallest sample (1-based, clipped to the count):
        its bucket's middle."""
        rank = min(max(rank, 1), self.total)
        seen = 0
        for index in sorted(self.counts):
            seen += self.counts[index]
            if seen >= rank:
                return _FLOOR_MS * _RATIO ** (index + 0.5)
        return math.nan

    def quantile(self, q: float) -> float:
        """The ``q`` quantile (NaN with no sample)."""
        if not self.total:
            return math.nan
        return self.at_rank(math.ceil(q * self.total))

    def bounds(self, q: float, z: float = 1.645) -> tuple[float, float]:
        """A two-sided confidence interval of the ``q`` quantile (90 % with the default
        ``z``), from the ranks of the order statistics around ``q * n`` (the normal
        approximation of the binomial). With few samples the upper bound is the largest."""
        n = self.total
        if not n:
            return math.nan, math.nan
        spread = z * math.sqrt(n * q * (1 - q))
        return self.at_rank(math.floor(n * q - spread)), self.at_rank(math.ceil(n * q + spread) + 1)

    def to_dict(self) -> dict[str, Any]:
        return {"counts": {str(k): v for k, v in self.counts.items()}, "total": self.total}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> LatencyHistogram:
        counts = {int(k): int(v) for k, v in (data.get("counts") or {}).items()}
        return cls(counts, int(data.get("total", sum(counts.values()))))


@dataclass
class VersionWindow:
    """One version's requests in one step."""

    requests: int = 0
    errors: int = 0
    """Answered 5xx, or a stream that ended with an error (engine or worker)."""
    ttft: LatencyHistogram = field(default_factory=LatencyHistogram)
    e2e: LatencyHistogram = field(default_factory=LatencyHistogram)

    def record(self, error: bool, ttft_ms: float | None, e2e_ms: float) -> None:
        self.requests += 1
        if error:
            self.errors += 1
            return  # an error's latency says nothing of the version's speed
        if ttft_ms is not None:
            self.ttft.add(ttft_ms)
        self.e2e.add(e2e_ms)

    def merge(self, other: VersionWindow) -> None:
        self.requests += other.requests
        self.errors += other.errors
        self.ttft.merge(other.ttft)
        self.e2e.merge(other.e2e)

    def to_dict(self) -> dict[str, Any]:
        return {"requests": self.requests, "errors": self.errors,
                "ttft": self.ttft.to_dict(), "e2e": self.e2e.to_dict()}  # fmt: skip

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> VersionWindow:
        return cls(
            int(data.get("requests", 0)),
            int(data.get("errors", 0)),
            LatencyHistogram.from_dict(data.get("ttft") or {}),
            LatencyHistogram.from_dict(data.get("e2e") or {}),
        )


class RolloutStats:
    """Every rollout's counts on this node: ``(rollout, window) -> {role: counts}``.
    Written by the gateway (event loop), read by the rollout controller (another thread)."""

    def __init__(self) -> None:
        self._windows: dict[tuple[str, int], dict[str, VersionWindow]] = {}
        self._lock = threading.Lock()

    def record(
        self, rollout: str, step: int, role: str, error: bool, ttft_ms: float | None, e2e_ms: float
    ) -> None:
        with self._lock:
            windows = self._windows.setdefault((rollout, step), {})
            window = windows.get(role)
            if window is None:
                window = windows[role] = VersionWindow()
            window.record(error, ttft_ms, e2e_ms)

    def window(self, rollout: str, step: int) -> dict[str, VersionWindow]:
        """A copy of one step's windows (both roles, empty when nothing was counted)."""
        with self._lock:
            found = self._windows.get((rollout, step), {})
            out = {role: VersionWindow() for role in ROLES}
            for role, window in found.items():
                out[role].merge(window)
            return out

    def forget(self, keep: Iterable[tuple[str, int]]) -> None:
        """Drop every window but those of ``keep`` (the steps in force)."""
        wanted = set(keep)
        with self._lock:
            for key in [k for k in self._windows if k not in wanted]:
                del self._windows[key]

    def snapshot(self) -> dict[str, dict[str, Any]]:
        """Every window as JSON (``"rollout/step" -> {role: window}``), for other nodes."""
        with self._lock:
            return {f"{r}/{s}": {role: w.to_dict() for role, w in windows.items()}
                    for (r, s), windows in self._windows.items()}  # fmt: skip
