"""Enflame (燧原) GCUs (云燧 T20/T21, S60) through ``efsmi``.

No public sample of ``efsmi`` output is in ``tests/fixtures``. The parser follows Enflame's
"EFSMI 用户使用手册" (TopsRider 2.x / 3.x, efsmi 1.x) for the default table, two lines per
GCU::

    | EFSMI: 1.15.0.14        Driver Ver: 1.15.0.14                               |
    |-----------------------------------------------------------------------------|
    | DEV    NAME                | FW VER          | BUS-ID      ECC              |
    | TEMP   Dpm   Pwr(Usage/Cap)| Mem     GCU Virt| DUsed       SN               |
    |-----------------------------------------------------------------------------|
    | 0      Enflame T20         | 26.5.3          | 00:2e:00.0  Enable           |
    | 34C    Sleep    31W  300W  | 32GiB   Disable | 0.0%        A0610520309003   |

``Mem`` is the total device memory; the table does not show memory in use, and has no
health word (health unknown, treated as OK). ``DUsed`` is the device utilization. EFSMI
documents no peer-to-peer query, so ``p2p_capable`` stays unknown.

torch: the extension is ``torch_gcu`` (device ``gcu``), devices selected with
``TOPS_VISIBLE_DEVICES``.
"""

from __future__ import annotations

import re

from kunlun.device.plugin import DevicePlugin, Discovery, Health, ProbedDevice
from kunlun.device.plugins.smi_output import (
    dtypes_for_name,
    parse_float,
    parse_mib,
    parse_table_rows,
    set_parsed,
)
from kunlun.device.tools import ToolRunner
from kunlun.errors import ToolError

#: Data-sheet dtypes (Enflame product pages: 云燧 T20 / T21 FP32/TF32/FP16/BF16/INT8;
#: 云燧 S60 FP32/FP16/BF16/INT8).
_DTYPES = {
    "T20": ["fp32", "bf16", "fp16", "int8"],
    "T21": ["fp32", "bf16", "fp16", "int8"],
    "S60": ["fp32", "bf16", "fp16", "int8"],
}
_BUS = re.compile(r"(?:[0-9a-fA-F]{2,8}:)?[0-9a-fA-F]{2}:[0-9a-fA-F]{2}\.[0-7]")


def dtypes_for_model(name: str) -> list[str] | None:
    """Supported dtypes of an Enflame GCU from its name (None when the model is unknown)."""
    return dtypes_for_name(_DTYPES, name)


class EnflamePlugin(DevicePlugin):
    device_type = "enflame"
    vendor = "Enflame"
    tools = ("efsmi",)
    visibility_env = "TOPS_VISIBLE_DEVICES"
    runtime_env = ("LD_LIBRARY_PATH",)
    torch_device_type = "gcu"
    distributed_backend = "eccl"
    torch_module = "torch_gcu"
    memory_fields = None
    custom_attributes = {"topsgraph_enabled": bool}
    compute_unit_dtype = "fp16"
    pci_vendor_ids = ("1e36",)
    device_nodes = ("/dev/gcu[0-9]*",)

    def discover(self, tools: ToolRunner) -> Discovery:
        if not tools.available("efsmi"):
            return Discovery(notes=["efsmi not found"], tool_found=False)
        devices = parse_efsmi(tools.run(["efsmi"]))
        notes = ["p2p unknown: efsmi has no peer-to-peer query"]
        if not devices:
            notes.append("efsmi reports no GCUs")
        return Discovery(devices, notes)


def parse_efsmi(text: str, command: str = "efsmi") -> list[ProbedDevice]:
    """Devices from the ``efsmi`` table; :class:`ToolError` when it has no GCU rows."""
    rows = parse_table_rows(text)
    if not rows:
        if not text.strip():
            return []
        raise ToolError(f"'{command}' output has no GCU rows")
    driver = re.search(r"Driver Ver:\s*(\S+)", text)
    devices: dict[int, ProbedDevice] = {}
    for first, second in rows:
        tokens = first[0].split()
        device = ProbedDevice("enflame", int(tokens[0]), " ".join(tokens[1:]) or "enflame")
        device.health = Health.UNKNOWN
        if len(tokens) < 2:
            device.problems.append("efsmi gives no GCU name")
        if driver is not None:
            device.attributes["driver_version"] = driver.group(1)
        if len(first) > 1 and first[1]:
            device.attributes["firmware"] = first[1]
        bus = _BUS.search(first[2]) if len(first) > 2 else None
        device.bus_id = bus.group().lower() if bus else None
        _second_line(device, second)
        device.supported_dtypes = dtypes_for_model(device.name)
        devices.setdefault(device.index, device)
    return sorted(devices.values(), key=lambda d: d.index)


def _second_line(device: ProbedDevice, cells: list[str] | None) -> None:
    if cells is None or len(cells) < 2:
        device.problems.append("efsmi row is cut short: memory unknown")
        return
    memory = re.match(r"^\s*(\d+(?:\.\d+)?\s*[KMGT]i?B)\b", cells[1], re.IGNORECASE)
    if memory is None:
        device.problems.append(f"memory {cells[1]!r} is not a size")
    else:
        set_parsed(device, "memory_total_mb", memory.group(1), parse_mib)
    temp = re.match(r"^\s*(\d+(?:\.\d+)?)\s*C\b", cells[0])
    device.temperature_c = float(temp.group(1)) if temp else None
    power = re.search(r"(\d+(?:\.\d+)?)\s*W\b", cells[0])
    device.power_w = float(power.group(1)) if power else None
    if len(cells) > 2 and cells[2].split():
        try:
            device.utilization_pct = parse_float(cells[2].split()[0])
        except ValueError as exc:
            device.problems.append(f"utilization: {exc}")
