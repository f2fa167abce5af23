"""The memory ledger: what placed workloads hold on each device.

Weights are reserved whole. The KV memory of a device is not reserved but *shared*: the
workloads on a device split the memory left after all their weights in proportion to their
priority weights (3:2:1 for high:normal:low, the seed's reservation weights). A newcomer fits
only when that split still leaves every sharer, itself included, at least its minimum KV (one
sequence of its ``max_model_len``). The ledger keeps per device the sum of weights, the sum of
priority weights and the largest ``min_kv / priority weight`` of its sharers, so the check is
O(1).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kunlun.planner.capacity import DeviceCapacity


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
