"""``kunlun-cli doctor``: one readable environment report with a fix for each problem.

Checks, in the order an operator would: the kernel; each vendor plugin's tool and what it
found; PCI accelerators present with no driver bound; accelerator device nodes
(``/dev/davinci*``, ``/dev/accel*``, ...); whether we run in a container and which container
runtimes exist; the ports Kunlun and engines use; torch and the vendor torch extensions.
With ``--replay DIR`` the vendor checks read the recorded node and host-only checks say so.
"""

from __future__ import annotations

import glob
import importlib.util
import os
import platform
from dataclasses import asdict, dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any

import psutil
from rich.console import Console
from rich.table import Table

from kunlun.address import DEFAULT_PORT
from kunlun.device.plugin import DevicePlugin
from kunlun.device.registry import PluginReport, discover_all
from kunlun.device.tools import ToolRunner

#: Ports checked for conflicts: Kunlun's API and the usual engine / monitoring ports.
PORTS = {
    DEFAULT_PORT: "kunlun-platform API",
    8000: "vLLM",
    8080: "llama.cpp server",
    30000: "SGLang",
    9090: "Prometheus",
}
_ACCEL_PCI_CLASSES = ("0x03", "0x12", "0x0b40")  # display, processing accelerator, co-processor


class Level(StrEnum):
    OK = "ok"
    INFO = "info"
    WARN = "warn"
    FAIL = "fail"


@dataclass
class Check:
    area: str
    name: str
    level: Level
    detail: str
    fix: str | None = None


@dataclass
class DoctorReport:
    checks: list[Check] = field(default_factory=list)
    replay_dir: str | None = None

    def add(self, area: str, name: str, level: Level, detail: str, fix: str | None = None) -> None:
        self.checks.append(Check(area, name, level, detail, fix))

    def exit_code(self) -> int:
        return 1 if any(c.level is Level.FAIL for c in self.checks) else 0

    def to_dict(self) -> dict[str, Any]:
        return {
            "replay": self.replay_dir,
            "checks": [asdict(c) for c in self.checks],
            "exit_code": self.exit_code(),
        }


def run_doctor(replay: Path | None = None) -> DoctorReport:
    """Run every check; never raises for what it finds, only reports."""
    from kunlun.device.inventory import resolve_replay_dir

    replay_dir = resolve_replay_dir(replay)
    report = DoctorReport(replay_dir=str(replay_dir) if replay_dir else None)
    _check_kernel(report, replay_dir)
    reports = discover_all(replay_dir)
    for r in reports:
        _check_plugin(report, r, replay_dir)
    if replay_dir is None:
        _check_pci(report, [r.plugin for r in reports if r.plugin is not None])
        _check_device_nodes(report)
        _check_container(report)
        _check_ports(report)
        _check_torch(report, [r.plugin for r in reports if r.plugin is not None])
    else:
        report.add(
            "host",
            "live checks",
            Level.INFO,
            "PCI, device nodes, container, ports and "
            "torch describe this machine, not the replayed node: skipped",
        )
    return report


def _check_kernel(report: DoctorReport, replay_dir: Path | None) -> None:
    if replay_dir is not None:
        runner = ToolRunner(replay_dir=replay_dir)
        if runner.available("uname"):
            report.add("system", "kernel", Level.OK, runner.run(["uname", "-a"]).strip())
        else:
            report.add("system", "kernel", Level.INFO, "no uname recording in the replay directory")
        return
    u = platform.uname()
    report.add("system", "kernel", Level.OK, f"{u.system} {u.release} {u.machine}")


def _check_plugin(report: DoctorReport, r: PluginReport, replay_dir: Path | None) -> None:
    plugin = r.plugin
    name = f"{r.device_type} plugin"
    if plugin is None or r.error:
        report.add(
            "devices",
            name,
            Level.FAIL,
            r.error or "not loaded",
            "reinstall the plugin package; run `kunlun-device-probe --verbose` for the commands",
        )
        return
    tools = ", ".join(plugin.tools) or "(none)"
    if r.devices:
        report.add("devices", name, Level.OK, f"tool {tools} found; {len(r.devices)} device(s)")
    elif r.tool_found:
        report.add(
            "devices",
            name,
            Level.WARN,
            f"tool {tools} found but it reports no device",
            "check the driver is loaded (lsmod) and the device is visible in this container",
        )
    else:
        report.add(
            "devices",
            name,
            Level.INFO,
            f"tool {tools} not found" + (" in the replay directory" if replay_dir else " on PATH"),
        )


def _check_pci(report: DoctorReport, plugins: list[DevicePlugin]) -> None:
    vendors = {vid.lower(): p for p in plugins for vid in p.pci_vendor_ids}
    found = 0
    for dev in sorted(Path("/sys/bus/pci/devices").glob("*")):
        try:
            vendor = (dev / "vendor").read_text().strip().removeprefix("0x").lower()
            pci_class = (dev / "class").read_text().strip()
        except OSError:
            continue
        plugin = vendors.get(vendor)
        if plugin is None or not pci_class.startswith(_ACCEL_PCI_CLASSES):
            continue
        found += 1
        if not (dev / "driver").exists():
            report.add(
                "drivers",
                f"PCI {dev.name}",
                Level.FAIL,
                f"{plugin.vendor} accelerator (vendor {vendor}, class {pci_class}) has no driver bound",
                f"install and load the {plugin.vendor} kernel driver, then re-run doctor",
            )
        else:
            driver = os.path.basename(os.readlink(dev / "driver"))
            report.add(
                "drivers",
                f"PCI {dev.name}",
                Level.OK,
                f"{plugin.vendor} accelerator, driver {driver}",
            )
    if not found:
        report.add(
            "drivers",
            "PCI accelerators",
            Level.INFO,
            "no accelerator of a known vendor on the PCI bus",
        )


def _check_device_nodes(report: DoctorReport) -> None:
    patterns = [
        "/dev/davinci*",
        "/dev/accel*",
        "/dev/nvidia[0-9]*",
        "/dev/kfd",
        "/dev/cambricon_dev*",
        "/dev/mtgpu*",
        "/dev/xpu*",
        "/dev/gcu*",
    ]
    nodes = sorted(n for p in patterns for n in glob.glob(p))
    if nodes:
        report.add(
            "drivers",
            "device nodes",
            Level.OK,
            " ".join(nodes[:12]) + (" ..." if len(nodes) > 12 else ""),
        )
    else:
        report.add(
            "drivers",
            "device nodes",
            Level.INFO,
            "no accelerator device nodes (/dev/davinci*, /dev/accel*, ...)",
        )


def _check_container(report: DoctorReport) -> None:
    inside = Path("/.dockerenv").exists() or Path("/run/.containerenv").exists()
    try:
        cgroup = Path("/proc/1/cgroup").read_text()
        inside = inside or any(w in cgroup for w in ("docker", "kubepods", "containerd", "lxc"))
    except OSError:
        pass
    report.add(
        "container",
        "inside a container",
        Level.INFO,
        "yes" if inside else "no",
        "pass devices into the container (vendor runtime hook or --device)" if inside else None,
    )
    runner = ToolRunner(timeout_s=5)
    for tool in ("docker", "podman", "nerdctl"):
        if not runner.available(tool):
            continue
        try:
            runtimes = runner.run([tool, "info", "--format", "{{json .Runtimes}}"]).strip()
            report.add("container", f"{tool} runtimes", Level.OK, runtimes[:200])
        except Exception as exc:  # noqa: BLE001 - report, never fail the doctor
            report.add(
                "container",
                f"{tool} runtimes",
                Level.WARN,
                f"{tool} client present but: {exc}",
                f"start the {tool} daemon, or ignore if containers are not used",
            )


def _check_ports(report: DoctorReport) -> None:
    try:
        conns = psutil.net_connections(kind="inet")
    except (psutil.AccessDenied, OSError) as exc:
        report.add("network", "ports", Level.WARN, f"cannot list sockets: {exc}")
        return
    listening = {c.laddr.port: c.pid for c in conns if c.status == psutil.CONN_LISTEN and c.laddr}
    for port, use in PORTS.items():
        if port not in listening:
            report.add("network", f"port {port}", Level.OK, f"free ({use})")
            continue
        pid = listening[port]
        owner = _process_name(pid)
        report.add(
            "network",
            f"port {port}",
            Level.WARN,
            f"in use by {owner} ({use} port)",
            f"stop {owner} or start Kunlun with --port",
        )


def _process_name(pid: int | None) -> str:
    if pid is None:
        return "an unknown process"
    try:
        return f"{psutil.Process(pid).name()} (pid {pid})"
    except psutil.Error:
        return f"pid {pid}"


def _check_torch(report: DoctorReport, plugins: list[DevicePlugin]) -> None:
    spec = importlib.util.find_spec("torch")
    if spec is None:
        report.add(
            "python",
            "torch",
            Level.WARN,
            "torch is not installed; the embedded engine cannot run",
            "pip install torch==<version for your chip> (see docs/devices.md: per-vendor installs)",
        )
    else:
        report.add("python", "torch", Level.OK, f"installed at {Path(spec.origin or '').parent}")
    for p in plugins:
        if p.torch_module and p.torch_extension_available():
            report.add("python", p.torch_module, Level.OK, f"{p.vendor} torch extension importable")


def render(report: DoctorReport, console: Console) -> None:
    """Print the report as a table, then the suggested fixes."""
    title = "Kunlun doctor" + (f" (replay {report.replay_dir})" if report.replay_dir else "")
    table = Table(title=title, title_justify="left")
    for col in ("AREA", "CHECK", "RESULT", "DETAIL"):
        table.add_column(col)
    style = {Level.OK: "green", Level.INFO: "cyan", Level.WARN: "yellow", Level.FAIL: "red"}
    for c in report.checks:
        table.add_row(c.area, c.name, f"[{style[c.level]}]{c.level.value}[/]", c.detail)
    console.print(table)
    fixes = [c for c in report.checks if c.fix and c.level in (Level.WARN, Level.FAIL)]
    for c in fixes:
        console.print(f"[bold]fix[/] {c.name}: ", end="")
        console.print(c.fix, markup=False)
    if not fixes:
        console.print("No problems found.")
