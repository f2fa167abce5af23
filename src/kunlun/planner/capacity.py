"""A device profile reduced to the numbers planning and placement need, computed once.

:class:`DeviceCapacity` is a plain slotted object (no pydantic, no provenance lookups), so the
placement loop can compare thousands of devices quickly. Its ``signature`` groups identical
devices into classes: placement judges a class once and then only picks among its devices by
free memory.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kunlun.device.profile import DeviceProfile, Status

#: Fraction of a device's memory that Kunlun plans to use; the rest is left for activations,
#: the framework's workspace and fragmentation. A workload spec's ``memory_utilization``
#: (vLLM's ``--gpu-memory-utilization``) replaces it for that workload's plans.
MEMORY_UTILIZATION = 0.9
_NONE: frozenset[str] = frozenset()

#: Host-side half of each vendor's memory split -> the device-side field that feeds
#: ``memory_total_mb`` (see ``device.declaration.MEMORY_SPLIT_FIELDS``).
_SPLIT = {
    "sys_memory_mb": "hbm_memory_mb",
    "ddr_memory_mb": "mlu_memory_mb",
    "gddr6_memory_mb": "vram_memory_mb",
}


@dataclass(slots=True)
class DeviceCapacity:
    """What one device offers a workload. Memory in MiB, compute in TFLOPS (TOPS for ints)."""

    device_id: str
    device_type: str
    index: int
    status: Status
    memory_total_mb: float
    usable_mb: float
    """:func:`usable_memory_mb`: ``memory_total_mb * utilization`` minus what was in use
    when probed."""
    dtypes: frozenset[str]
    emulated: frozenset[str]
    """Dtypes listed as supported but computed without native units (the profile's
    ``attributes`` say ``<dtype>_native: no``); preferred after fp32."""
    compute: dict[str, float]
    bandwidth_gbps: float | None
    p2p: bool
    topology: tuple[int, ...] | None
    torch_device_type: str
    visibility_env: str | None
    custom_attributes: dict[str, Any]
    memory_source: str
    """The declaration field (and its provenance) that gave ``memory_total_mb``."""
    host_memory_mb: float | None
    """The host-side half of the vendor memory split (sys/ddr/gddr6), not used for KV."""
    reasons: tuple[str, ...] = ()
    signature: tuple[Any, ...] = field(default=(), repr=False)
    utilization: float = MEMORY_UTILIZATION
    """The fraction of ``memory_total_mb`` that ``usable_mb`` was computed with."""

    @property
    def host_memory(self) -> bool:
        """The device computes in host RAM (the CPU): KV memory is capped by default."""
        return self.torch_device_type == "cpu"

    @property
    def degraded(self) -> bool:
        return self.status is Status.DEGRADED


def usable_fraction(utilization: float | None) -> float:
    """The fraction of device memory a plan may use: a spec's ``utilization``, or the
    default :data:`MEMORY_UTILIZATION` when it sets none."""
    return MEMORY_UTILIZATION if utilization is None else utilization


def usable_memory_mb(total_mb: float, used_mb: float, utilization: float | None = None) -> float:
    """The memory a plan may use on a device of ``total_mb`` with ``used_mb`` already in use:
    ``total * fraction - used`` (:func:`usable_fraction`), never below zero."""
    return max(0.0, total_mb * usable_fraction(utilization) - used_mb)


def capacity_of(profile: DeviceProfile, utilization: float | None = None) -> DeviceCapacity:
    """The :class:`DeviceCapacity` of ``profile`` for plans that may use ``utilization`` of
    its memory (None: :data:`MEMORY_UTILIZATION`). This runs for every device of an
    inventory, so it reads each field once and shares (does not copy) the profile's dicts,
    which nothing modifies."""
    values = {name: f.value for name, f in profile.fields.items()}
    get = values.get
    total = float(get("memory_total_mb") or 0)
    dtypes = frozenset(get("supported_dtypes") or ())
    attributes = get("attributes")
    emulated = (
        frozenset(d for d in dtypes if attributes.get(f"{d}_native") == "no")
        if attributes
        else _NONE
    )
    compute = get("compute_tflops") or {}
    bandwidth = get("memory_bandwidth_gbps")
    topology = get("topology_distance")
    custom = get("custom_attributes") or {}
    host_field = next((f for f in _SPLIT if f in values), None)
    memory = profile.fields.get("memory_total_mb")
    source = _SPLIT[host_field] if host_field else "memory_total_mb"
    cap = DeviceCapacity(
        f"{profile.device_type}:{profile.index}",
        profile.device_type,
        profile.index,
        profile.status,
        total,
        usable_memory_mb(total, float(get("memory_used_mb") or 0), utilization),
        dtypes,
        emulated,
        compute,
        float(bandwidth) if bandwidth else None,
        bool(get("p2p_enabled")),
        tuple(topology) if topology else None,
        profile.torch_device_type,
        profile.visibility_env,
        custom,
        f"{source} ({memory.provenance.value if memory else 'unknown'})",
        float(values[host_field]) if host_field else None,
        tuple(profile.reasons),
        utilization=usable_fraction(utilization),
    )
    cap.signature = (profile.device_type, profile.status, total, dtypes, emulated,
                     tuple(compute.items()), cap.bandwidth_gbps, cap.p2p,
                     profile.torch_device_type, tuple(custom.items()))  # fmt: skip
    return cap


def distance(a: DeviceCapacity, b: DeviceCapacity) -> int | None:
    """Declared topology distance between two devices of one type, or None when unknown."""
    if a.topology is None or b.index >= len(a.topology):
        return None
    return a.topology[b.index]
