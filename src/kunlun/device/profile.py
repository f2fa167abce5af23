"""Device profiles: probed facts merged with the declaration, every field with its provenance.

A :class:`DeviceProfile` is what the rest of Kunlun (planner, scheduler, CLI) sees of a
device. Each field records where its value came from:

- ``probed``: read from the hardware (vendor tool, torch extension, /proc);
- ``declared``: written by the operator and not contradicted, but not checkable either;
- ``validated``: written by the operator and confirmed by the probe;
- ``defaulted``: neither; a documented default or a value derived from another field.

:func:`merge` applies the declaration rules and sets STATUS with the reasons.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from enum import StrEnum
from typing import Any

from kunlun.device.declaration import DeclaredDevice
from kunlun.device.dtypes import COMPUTE_FIELDS, normalize_compute
from kunlun.device.plugin import DevicePlugin, Health, ProbedDevice


class Status(StrEnum):
    READY = "Ready"
    DEGRADED = "Degraded"  # usable, with limits named in the reasons
    UNHEALTHY = "Unhealthy"  # the hardware reports a fault
    EXCLUDED = "Excluded"  # not used: the declaration contradicts the hardware, or not found


_STATUS_RANK = {Status.READY: 0, Status.DEGRADED: 1, Status.UNHEALTHY: 2, Status.EXCLUDED: 3}


class Provenance(StrEnum):
    PROBED = "probed"
    DECLARED = "declared"
    VALIDATED = "validated"
    DEFAULTED = "defaulted"


@dataclass
class ProfileField:
    value: Any
    provenance: Provenance


VOLATILE_FIELDS = frozenset(
    {"memory_used_mb", "utilization_pct", "memory_bandwidth_util_pct", "temperature_c", "power_w"}
)
"""Readings that change from one moment to the next (not facts of the device)."""


@dataclass
class DeviceProfile:
    """One device as Kunlun trusts it: values with provenance, a status and its reasons."""

    device_type: str
    index: int
    status: Status = Status.READY
    reasons: list[str] = field(default_factory=list)
    fields: dict[str, ProfileField] = field(default_factory=dict)
    visibility_env: str | None = None
    torch_device_type: str = "cpu"

    @property
    def id(self) -> str:
        return f"{self.device_type}:{self.index}"

    def get(self, name: str, default: Any = None) -> Any:
        f = self.fields.get(name)
        return default if f is None else f.value

    def set(self, name: str, value: Any, provenance: Provenance) -> None:
        if value is not None:
            self.fields[name] = ProfileField(value, provenance)

    def degrade(self, status: Status, reason: str) -> None:
        """Record ``reason``; the status only ever gets worse."""
        self.reasons.append(reason)
        if _STATUS_RANK[status] > _STATUS_RANK[self.status]:
            self.status = status

    @property
    def usable(self) -> bool:
        return self.status in (Status.READY, Status.DEGRADED)

    def supports(self, dtype: str) -> bool:
        """Whether ``dtype`` may be used on this device (validated or declared)."""
        return dtype in (self.get("supported_dtypes") or [])

    @property
    def name(self) -> str:
        return str(self.get("name", self.device_type))

    def at_rest(self) -> DeviceProfile:
        """This profile without its moment-to-moment readings (:data:`VOLATILE_FIELDS`): the
        device as a plan for another time sees it, idle (a signed package's plan)."""
        fields = {k: v for k, v in self.fields.items() if k not in VOLATILE_FIELDS}
        return replace(self, fields=fields, reasons=list(self.reasons))

    def to_dict(self) -> dict[str, Any]:
        """The JSON form used by ``device list --json`` and (later) the API."""
        out: dict[str, Any] = {
            "id": self.id,
            "type": self.device_type,
            "index": self.index,
            "name": self.name,
            "status": self.status.value,
            "memory_total_mb": self.get("memory_total_mb"),
            "memory_used_mb": self.get("memory_used_mb"),
            "utilization_pct": self.get("utilization_pct"),
            "topology": self.get("topology_distance"),
            "reasons": list(self.reasons),
            "visibility_env": self.visibility_env,
            "torch_device_type": self.torch_device_type,
        }
        for name, f in self.fields.items():
            out.setdefault(name, f.value)
        out["provenance"] = {name: f.provenance.value for name, f in self.fields.items()}
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> DeviceProfile:
        """The profile :meth:`to_dict` wrote (a cluster node's devices, as another node sees
        them)."""
        fields = {
            name: ProfileField(data.get(name), Provenance(provenance))
            for name, provenance in (data.get("provenance") or {}).items()
        }
        return cls(
            device_type=str(data["type"]),
            index=int(data["index"]),
            status=Status(data.get("status", Status.READY.value)),
            reasons=list(data.get("reasons") or []),
            fields=fields,
            visibility_env=data.get("visibility_env"),
            torch_device_type=str(data.get("torch_device_type") or "cpu"),
        )


def from_probe(plugin: DevicePlugin, probed: ProbedDevice) -> DeviceProfile:
    """A profile from probed facts alone (no declaration)."""
    profile = DeviceProfile(
        device_type=probed.device_type,
        index=probed.index,
        visibility_env=plugin.visibility_env,
        torch_device_type=plugin.torch_device_type,
    )
    p = Provenance.PROBED
    for name in (
        "name",
        "bus_id",
        "uuid",
        "memory_total_mb",
        "memory_used_mb",
        "utilization_pct",
        "memory_bandwidth_util_pct",
        "temperature_c",
        "power_w",
        "supported_dtypes",
    ):
        profile.set(name, getattr(probed, name), p)
    profile.set("p2p_enabled", probed.p2p_capable, p)
    profile.set("topology_distance", probed.topology, p)
    if probed.attributes:
        profile.set("attributes", dict(probed.attributes), p)
    if probed.supported_dtypes is None:
        profile.set("supported_dtypes", ["fp32", "fp16"], Provenance.DEFAULTED)
    _apply_health(profile, probed)
    for problem in probed.problems:
        profile.degrade(Status.DEGRADED, problem)
    return profile


def _apply_health(profile: DeviceProfile, probed: ProbedDevice) -> None:
    raw = probed.health_detail or probed.health.value
    profile.set("health", raw, Provenance.PROBED)
    if probed.health is Health.WARNING:
        profile.degrade(Status.DEGRADED, f"vendor tool reports health {raw!r}")
    elif probed.health is Health.UNHEALTHY:
        profile.degrade(Status.UNHEALTHY, f"vendor tool reports health {raw!r}")


def merge(plugin: DevicePlugin, probed: ProbedDevice, declared: DeclaredDevice) -> DeviceProfile:
    """Merge a declaration into the probed profile, applying the declaration rules."""
    profile = from_probe(plugin, probed)
    decl = declared.decl
    if decl.name:
        profile.set("name", decl.name, Provenance.DECLARED)
    _merge_memory(plugin, profile, declared)
    _merge_p2p(profile, declared)
    _merge_dtypes(profile, declared)
    _merge_compute(profile, declared)
    for name in ("memory_bandwidth_gbps", "p2p_bandwidth_gbps"):
        profile.set(name, getattr(decl, name), Provenance.DECLARED)
    if decl.custom_attributes:
        profile.set("custom_attributes", dict(decl.custom_attributes), Provenance.DECLARED)
        _check_attributes(plugin, profile, declared)
    return profile


def _merge_memory(plugin: DevicePlugin, profile: DeviceProfile, declared: DeclaredDevice) -> None:
    decl = declared.decl
    device_field, host_field = plugin.memory_fields or ("total_memory_mb", "")
    name = device_field if getattr(decl, device_field, None) is not None else "total_memory_mb"
    value = getattr(decl, name)
    if host_field:
        profile.set(host_field, getattr(decl, host_field), Provenance.DECLARED)
    if value is None:
        return
    probed = profile.get("memory_total_mb")
    if probed is None:
        profile.set("memory_total_mb", value, Provenance.DECLARED)
    elif value > probed:
        profile.degrade(
            Status.EXCLUDED,
            f"{declared.where(name)}: declared {name}={value} MB is above the "
            f"{probed} MB the hardware reports",
        )
    else:
        profile.set("memory_total_mb", value, Provenance.VALIDATED)


def _merge_p2p(profile: DeviceProfile, declared: DeclaredDevice) -> None:
    decl = declared.decl
    if decl.p2p_enabled is None:
        return
    probed = profile.fields.get("p2p_enabled")
    if probed is None:
        profile.set("p2p_enabled", decl.p2p_enabled, Provenance.DECLARED)
    elif decl.p2p_enabled and not probed.value:
        profile.set("p2p_enabled", False, Provenance.PROBED)
        profile.degrade(
            Status.DEGRADED,
            f"{declared.where('p2p_enabled')}: p2p_enabled is declared true but the "
            "topology probe reports no peer-to-peer path; P2P is not used",
        )
    else:
        profile.set("p2p_enabled", decl.p2p_enabled, Provenance.VALIDATED)


def _merge_dtypes(profile: DeviceProfile, declared: DeclaredDevice) -> None:
    wanted = declared.decl.supported_dtypes
    if wanted is None:
        return
    probed = profile.fields.get("supported_dtypes")
    if probed is None or probed.provenance is not Provenance.PROBED:
        profile.set("supported_dtypes", list(wanted), Provenance.DECLARED)
        return
    unsupported = [d for d in wanted if d not in probed.value]
    kept = [d for d in wanted if d in probed.value]
    profile.set("supported_dtypes", kept, Provenance.VALIDATED)
    if unsupported:
        profile.degrade(
            Status.DEGRADED,
            f"{declared.where('supported_dtypes')}: declared {unsupported} but the hardware "
            f"supports only {probed.value}; exposing {kept}",
        )


def _merge_compute(profile: DeviceProfile, declared: DeclaredDevice) -> None:
    decl = declared.decl
    figures = {
        dtype: getattr(decl, name)
        for name, dtype in COMPUTE_FIELDS.items()
        if getattr(decl, name) is not None
    }
    normalized = normalize_compute(figures)
    if not normalized:
        return
    profile.set("compute_tflops", {d: v for d, (v, _) in normalized.items()}, Provenance.DECLARED)
    derived = sorted(d for d, (_, was_derived) in normalized.items() if was_derived)
    profile.set("compute_tflops_derived", derived, Provenance.DEFAULTED)


def _check_attributes(
    plugin: DevicePlugin, profile: DeviceProfile, declared: DeclaredDevice
) -> None:
    for key, value in declared.decl.custom_attributes.items():
        expected = plugin.custom_attributes.get(key)
        if expected is None:
            profile.reasons.append(
                f"{declared.where('custom_attributes')}: custom attribute {key!r} is not known "
                f"to the {plugin.device_type} plugin; kept but unused"
            )
        elif not isinstance(value, expected):
            profile.degrade(
                Status.DEGRADED,
                f"{declared.where('custom_attributes')}: custom attribute {key}={value!r} should "
                f"be {expected.__name__}; ignored",
            )
