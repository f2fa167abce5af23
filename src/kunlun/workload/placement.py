"""Choosing devices for a workload, with the reason for every device kept or rejected.

Filters return ``(kept, reasons)`` so every placement explains itself. This is the first,
simple policy (explicit device, preferred types in order, usable, runnable by the embedded
engine on this machine, then the first fit); the compiler orchestrator and the scheduler
replace it with memory fit and scoring.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field
from typing import Any

from kunlun.device.inventory import Inventory
from kunlun.device.profile import DeviceProfile, Status
from kunlun.errors import ConfigError, Location
from kunlun.workload.spec import WorkloadSpec

_EXTENSIONS = {"npu": "torch_npu", "mlu": "torch_mlu", "musa": "torch_musa", "gcu": "torch_gcu"}


@dataclass
class Placement:
    devices: list[DeviceProfile]
    dtype: str
    why: str
    rejected: dict[str, str] = field(default_factory=dict)

    @property
    def target_device(self) -> str:
        return ",".join(d.id for d in self.devices)

    def to_dict(self) -> dict[str, Any]:
        return {
            "target_device": self.target_device,
            "dtype": self.dtype,
            "why": self.why,
            "rejected": self.rejected,
        }


def runnable(profile: DeviceProfile) -> str | None:
    """None when the embedded engine can run on ``profile`` here, else why not."""
    kind = profile.torch_device_type
    if kind == "cpu":
        return None
    module = _EXTENSIONS.get(kind, "torch")
    if importlib.util.find_spec(module) is None:
        return f"the torch backend for {kind} ({module}) is not installed here"
    return None


def _filter(
    devices: list[DeviceProfile], spec: WorkloadSpec
) -> tuple[list[DeviceProfile], dict[str, str]]:
    kept: list[DeviceProfile] = []
    rejected: dict[str, str] = {}
    for d in devices:
        if spec.device and d.id != spec.device:
            continue
        if d.status not in (Status.READY, Status.DEGRADED):
            rejected[d.id] = f"status {d.status.value}: {'; '.join(d.reasons) or 'no reason'}"
        elif spec.dtype and not d.supports(spec.dtype):
            rejected[d.id] = (
                f"dtype {spec.dtype} not in supported_dtypes {d.get('supported_dtypes')}"
            )
        elif (why := runnable(d)) is not None:
            rejected[d.id] = why
        else:
            kept.append(d)
    return kept, rejected


def place(spec: WorkloadSpec, inventory: Inventory) -> Placement:
    """Devices for ``spec`` (one per replica, reused round-robin), or a ConfigError saying why."""
    if spec.device and inventory.get(spec.device) is None:
        known = ", ".join(p.id for p in inventory.profiles)
        raise ConfigError(
            f"device {spec.device!r} does not exist; devices: {known}", location=Location("device")
        )
    kept, rejected = _filter(inventory.profiles, spec)
    if not kept:
        detail = "; ".join(f"{k}: {v}" for k, v in rejected.items()) or "no device at all"
        raise ConfigError(
            f"no device can run this workload ({detail})", location=Location("device")
        )
    order = {t: i for i, t in enumerate(spec.preferred_device_types)}
    kept.sort(
        key=lambda d: (order.get(d.device_type, len(order)), d.status is Status.DEGRADED, d.id)
    )
    if spec.device:
        why = f"explicit device {spec.device}"
    elif spec.preferred_device_types and kept[0].device_type in order:
        why = f"first usable device of preferred type {kept[0].device_type}"
    else:
        why = "first usable device" + (f" ({len(rejected)} rejected)" if rejected else "")
    dtype = spec.dtype or _default_dtype(kept[0])
    return Placement(kept[: spec.replicas], dtype, why, rejected)


def _default_dtype(device: DeviceProfile) -> str:
    """fp32 on a CPU without native bf16; bf16 where the device supports it; else fp16."""
    if device.device_type == "cpu":
        attrs = device.get("attributes") or {}
        return "bf16" if attrs.get("bf16_native") == "yes" else "fp32"
    for dtype in ("bf16", "fp16"):
        if device.supports(dtype):
            return dtype
    return "fp32"
