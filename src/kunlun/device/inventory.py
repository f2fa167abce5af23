"""The inventory: every device profile with its STATUS and reasons.

:func:`build_inventory` runs every plugin (isolated; see :mod:`kunlun.device.registry`),
optionally reads ``device-plugin-config.yaml``, merges declarations into probed facts, checks
each type's topology matrix, and returns an :class:`Inventory` that the CLIs print.
"""

from __future__ import annotations

import os
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kunlun.device.declaration import DeclaredDevice, load_declarations
from kunlun.device.plugin import DevicePlugin
from kunlun.device.profile import DeviceProfile, Provenance, Status, from_probe, merge
from kunlun.device.registry import PluginReport, discover_all, load_plugins
from kunlun.device.topology import check_matrix

REPLAY_ENV = "KUNLUN_REPLAY_DIR"


@dataclass
class Inventory:
    """All device profiles, the plugin reports they came from, and the declarations."""

    profiles: list[DeviceProfile]
    reports: list[PluginReport]
    declarations: list[DeclaredDevice] = field(default_factory=list)
    config_path: str | None = None
    replay_dir: str | None = None

    def get(self, device_id: str) -> DeviceProfile | None:
        return next((p for p in self.profiles if p.id == device_id), None)

    def exit_code(self) -> int:
        """0 when every declared device (every device, with no config) is Ready, else 1."""
        wanted = {d.id for d in self.declarations}
        considered = [p for p in self.profiles if not wanted or p.id in wanted]
        return 0 if all(p.status is Status.READY for p in considered) else 1

    def to_list(self) -> list[dict[str, Any]]:
        return [p.to_dict() for p in self.profiles]


def resolve_replay_dir(replay: str | Path | None) -> Path | None:
    """``--replay DIR`` if given, else ``$KUNLUN_REPLAY_DIR``, else live discovery."""
    value = replay or os.environ.get(REPLAY_ENV)
    if not value:
        return None
    path = Path(value)
    if not path.is_dir():
        from kunlun.errors import ConfigError, Location

        raise ConfigError("replay directory does not exist", location=Location(str(path)))
    return path


def read_config(config: str | Path) -> list[DeclaredDevice]:
    """Load the declarations, validating device types against the registered plugins."""
    loaded = load_plugins()
    split = {t: p.memory_fields for t, p in loaded.plugins.items() if p.memory_fields}
    return load_declarations(config, loaded.plugins, split)


def build_inventory(
    config: str | Path | None = None,
    replay: str | Path | None = None,
    declarations: list[DeclaredDevice] | None = None,
) -> Inventory:
    """Discover, merge with the declaration (if any), and judge every device."""
    replay_dir = resolve_replay_dir(replay)
    if declarations is None:
        declarations = read_config(config) if config else []
    reports = discover_all(replay_dir)
    plugins = {r.device_type: r.plugin for r in reports if r.plugin is not None}
    by_id = {d.id: d for d in declarations}
    profiles: list[DeviceProfile] = []
    for report in reports:
        plugin = report.plugin
        if plugin is None:
            continue
        for probed in report.devices:
            declared = by_id.get(probed.id)
            profiles.append(
                merge(plugin, probed, declared) if declared else from_probe(plugin, probed)
            )
    seen = {p.id for p in profiles}
    for decl in declarations:
        if decl.id not in seen:
            profiles.append(_missing(decl, plugins.get(decl.decl.device_type), reports))
    _apply_topology(profiles, declarations)
    profiles.sort(key=lambda p: (p.device_type != "cpu", p.device_type, p.index))
    return Inventory(
        profiles,
        reports,
        declarations,
        str(config) if config else None,
        str(replay_dir) if replay_dir else None,
    )


def _missing(
    decl: DeclaredDevice, plugin: DevicePlugin | None, reports: list[PluginReport]
) -> DeviceProfile:
    """A declared device the probe did not find: Excluded, saying why."""
    profile = DeviceProfile(decl.decl.device_type, decl.decl.device_id)
    if plugin is not None:
        profile.visibility_env = plugin.visibility_env
        profile.torch_device_type = plugin.torch_device_type
    profile.set("name", decl.decl.name or decl.decl.device_type, Provenance.DECLARED)
    report = next((r for r in reports if r.device_type == decl.decl.device_type), None)
    if report is None or report.error:
        why = report.error if report else "no plugin"
    elif not report.tool_found:
        why = "the vendor tool is not installed (" + ", ".join(report.notes) + ")"
    else:
        why = f"the {decl.decl.device_type} plugin found {len(report.devices)} device(s)"
    profile.degrade(Status.EXCLUDED, f"{decl.where('device_id')}: declared but not found: {why}")
    return profile


def _apply_topology(profiles: list[DeviceProfile], declarations: list[DeclaredDevice]) -> None:
    """Check each type's declared matrix; safe degradation for a broken one."""
    by_type: dict[str, list[DeclaredDevice]] = defaultdict(list)
    for d in declarations:
        by_type[d.decl.device_type].append(d)
    index = {p.id: p for p in profiles}
    for decls in by_type.values():
        decls.sort(key=lambda d: d.decl.device_id)
        rows = [d.decl.topology_distance for d in decls]
        if all(r is None for r in rows):
            continue
        verdict = check_matrix(rows)
        k, n = verdict.num_consistent, verdict.num_devices
        for pos, decl in enumerate(decls):
            profile = index[decl.id]
            row = rows[pos]
            if pos < k:
                assert row is not None
                profile.set("topology_distance", row[:k], Provenance.DECLARED)
                if not verdict.complete or len(row) != n:
                    profile.degrade(
                        Status.DEGRADED,
                        f"{decl.where('topology_distance')}: safe degradation mode: the "
                        f"{n}-device matrix is inconsistent; using the consistent {k}x{k} part",
                    )
            else:
                why = verdict.problem if pos == k else f"device {k} already broke the matrix"
                profile.degrade(
                    Status.EXCLUDED,
                    f"{decl.where('topology_distance')}: safe degradation mode: "
                    f"{decl.id} is outside the consistent {k}x{k} topology matrix ({why})",
                )
