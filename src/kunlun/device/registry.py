"""Finding device plugins and running them in isolation.

Plugins are found through the entry-point group ``kunlun.device_plugins``; each entry point
names a :class:`~kunlun.device.plugin.DevicePlugin` subclass. Running them is isolated: a
plugin that cannot be loaded, raises, or hangs past its time limit becomes a
:class:`PluginReport` with an error, and every other plugin still reports its devices.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from functools import cache
from importlib.metadata import entry_points
from pathlib import Path

from kunlun.device.plugin import DevicePlugin, Discovery, ProbedDevice
from kunlun.device.tools import DEFAULT_TIMEOUT_S, CommandRecord, ToolRunner
from kunlun.errors import ConfigError, KunlunError
from kunlun.limits import seconds_from_env

ENTRY_POINT_GROUP = "kunlun.device_plugins"
#: A plugin gets this long in all (several tool calls) before it is reported as hung;
#: ``KUNLUN_PLUGIN_TIMEOUT_S`` overrides it.
PLUGIN_TIMEOUT_S = 3 * DEFAULT_TIMEOUT_S
TIMEOUT_ENV = "KUNLUN_PLUGIN_TIMEOUT_S"


def plugin_timeout_s() -> float:
    """The per-plugin time limit: ``$KUNLUN_PLUGIN_TIMEOUT_S`` or :data:`PLUGIN_TIMEOUT_S`."""
    return seconds_from_env(TIMEOUT_ENV, PLUGIN_TIMEOUT_S)


@dataclass
class PluginReport:
    """What one plugin produced: devices, notes, the commands it ran, or its error."""

    device_type: str
    devices: list[ProbedDevice] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    commands: list[CommandRecord] = field(default_factory=list)
    tool_found: bool = False
    error: str | None = None
    duration_ms: float = 0.0
    plugin: DevicePlugin | None = None


@dataclass
class LoadedPlugins:
    """Plugins by device type, plus entry points that failed to load."""

    plugins: dict[str, DevicePlugin]
    load_errors: dict[str, str]


@cache
def _registered() -> tuple[tuple[str, str, object], ...]:
    """Each entry point of ``kunlun.device_plugins`` as (name, value, the object it names or
    the exception loading it raised), once per process: entry points do not change while it
    runs, and the scan reads every installed distribution's metadata (about 9 ms, which a
    plan built per placement paid each time)."""
    out = []
    for ep in sorted(entry_points(group=ENTRY_POINT_GROUP), key=lambda e: e.name):
        try:
            loaded: object = ep.load()
        except Exception as exc:  # noqa: BLE001 - reported by load_plugins, per plugin
            loaded = exc
        out.append((ep.name, ep.value, loaded))
    return tuple(out)


def load_plugins() -> LoadedPlugins:
    """Instantiate every plugin registered in ``kunlun.device_plugins`` (found once per
    process, :func:`_registered`; new instances each call)."""
    plugins: dict[str, DevicePlugin] = {}
    errors: dict[str, str] = {}
    for name, value, cls in _registered():
        if isinstance(cls, Exception):  # its import failed (once; said on every call)
            errors[name] = f"cannot load plugin '{name}' ({value}): {cls!r}"
            continue
        try:
            if not (isinstance(cls, type) and issubclass(cls, DevicePlugin)):
                raise TypeError(f"{value} is not a DevicePlugin subclass")
            plugin = cls()
        except Exception as exc:  # noqa: BLE001 - a broken plugin must not stop the others
            errors[name] = f"cannot load plugin '{name}' ({value}): {exc!r}"
            continue
        plugins.setdefault(plugin.device_type, plugin)
    return LoadedPlugins(plugins, errors)


def known_device_types() -> list[str]:
    """Device types of every registered plugin (what declarations may name)."""
    return sorted(load_plugins().plugins)


def torch_extension(torch_device_type: str) -> str | None:
    """The extension module that registers ``torch_device_type`` with torch, as the device
    plugins say (their ``torch_module``); None when it is built into torch or no plugin
    claims the type. The plugins are the one owner of this fact: the engine's device
    resolver, placement and the operator registry all ask here.

    Raises :class:`ConfigError` naming the plugins when two of them disagree."""
    modules = {
        plugin.device_type: plugin.torch_module
        for plugin in load_plugins().plugins.values()
        if plugin.torch_device_type == torch_device_type
    }
    found = set(modules.values())
    if len(found) > 1:
        said = ", ".join(f"{name}: {module!r}" for name, module in sorted(modules.items()))
        raise ConfigError(
            f"device plugins disagree on the torch extension of device type "
            f"{torch_device_type!r} ({said})"
        )
    return found.pop() if found else None


def plugin_for_torch_device(torch_device_type: str) -> DevicePlugin | None:
    """A registered plugin whose devices are torch device type ``torch_device_type`` (the
    plugin of the same name first, e.g. ``cpu``), or None; for launches made by hand, where
    no plan names the device's plugin."""
    plugins = [p for p in load_plugins().plugins.values()
               if p.torch_device_type == torch_device_type]  # fmt: skip
    plugins.sort(key=lambda p: (p.device_type != torch_device_type, p.device_type))
    return plugins[0] if plugins else None


def run_plugin(
    plugin: DevicePlugin,
    replay_dir: Path | None = None,
    timeout_s: float | None = None,
    tool_timeout_s: float = DEFAULT_TIMEOUT_S,
) -> PluginReport:
    """Run one plugin's discovery in a worker thread, bounded by ``timeout_s``."""
    timeout_s = plugin_timeout_s() if timeout_s is None else timeout_s
    tool_timeout_s = min(tool_timeout_s, 0.8 * timeout_s)  # let the tool's own message through
    runner = ToolRunner(replay_dir=replay_dir, timeout_s=tool_timeout_s)
    report = PluginReport(device_type=plugin.device_type, plugin=plugin)
    box: dict[str, object] = {}

    def work() -> None:
        try:
            box["result"] = plugin.discover(runner)
        except KunlunError as exc:
            box["error"] = exc.message
        except Exception as exc:  # noqa: BLE001 - isolate plugin bugs
            box["error"] = f"plugin raised {exc!r}"

    start = time.monotonic()
    thread = threading.Thread(target=work, name=f"plugin-{plugin.device_type}", daemon=True)
    thread.start()
    thread.join(timeout_s)
    report.duration_ms = (time.monotonic() - start) * 1000
    report.commands = list(runner.records)
    if thread.is_alive():
        report.error = f"plugin did not finish within {timeout_s:g}s; its devices are not listed"
        return report
    if "error" in box:
        report.error = str(box["error"])
        report.tool_found = True
        return report
    result = box["result"]
    assert isinstance(result, Discovery)
    report.devices, report.notes, report.tool_found = (
        result.devices,
        result.notes,
        result.tool_found,
    )
    if replay_dir is None and not report.devices:
        _add_torch_source(plugin, report)
    return report


def _add_torch_source(plugin: DevicePlugin, report: PluginReport) -> None:
    """When the tool found nothing but the vendor's torch extension sees devices, use those."""
    try:
        devices = plugin.torch_devices()
    except Exception as exc:  # noqa: BLE001 - the second source is best effort
        report.notes.append(f"{plugin.torch_module} present but failed: {exc!r}")
        return
    if devices:
        report.devices = devices
        report.notes.append(f"devices from {plugin.torch_module} (vendor tool gave none)")


def discover_all(
    replay_dir: Path | None = None, timeout_s: float | None = None
) -> list[PluginReport]:
    """Run every registered plugin concurrently; one report per plugin, failures included."""
    timeout_s = plugin_timeout_s() if timeout_s is None else timeout_s
    loaded = load_plugins()
    reports: list[PluginReport] = [
        PluginReport(device_type=name, error=err) for name, err in loaded.load_errors.items()
    ]
    results: dict[str, PluginReport] = {}

    def one(plugin: DevicePlugin) -> None:
        results[plugin.device_type] = run_plugin(plugin, replay_dir, timeout_s)

    threads = [
        threading.Thread(target=one, args=(p,), daemon=True) for p in loaded.plugins.values()
    ]
    for t in threads:
        t.start()
    deadline = time.monotonic() + timeout_s + 1.0
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    for name, plugin in sorted(loaded.plugins.items()):
        reports.append(
            results.get(name)
            or PluginReport(device_type=name, plugin=plugin, error="plugin did not finish")
        )
    return sorted(reports, key=lambda r: r.device_type)
