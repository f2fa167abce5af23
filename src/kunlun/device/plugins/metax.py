"""MetaX (沐曦) GPUs (C500, C550, N260) through ``mx-smi``.

No public sample of ``mx-smi`` output is in ``tests/fixtures`` (only the normalized C500
inventory and topology, ``detect_output_metax_c500.json``). The parser follows MetaX's
"mx-smi 使用手册" (MACA 2.x / 3.x, mx-smi 2.1) for the default table, two lines per GPU::

    | MX-SMI 2.1.12                       Kernel Mode Driver Version: 2.9.8            |
    | MACA Version: 2.29.0.18             BIOS Version: 1.20.3.0                       |
    |------------------------------------+---------------------+----------------------+
    | GPU         NAME                   | Bus-id              | GPU-Util             |
    | Temp        Pwr:Usage/Cap          | Memory-Usage        |                      |
    |====================================+=====================+======================|
    | 0           MXC500                 | 0000:0e:00.0        | 0%                   |
    | 36C         71W / 350W             | 59963/65536 MiB     |                      |
    +------------------------------------+---------------------+----------------------+

and ``mx-smi topo -m`` for the ``topo -m`` link matrix (``MetaXLink`` is a fast link). The
table has no health word, so health is unknown (treated as OK).

torch: MetaX ships a PyTorch build on MACA whose devices are ``cuda`` devices (no extension
module to import), selected with ``CUDA_VISIBLE_DEVICES`` (MACA honours it like CUDA does).
"""

from __future__ import annotations

import re

from kunlun.device.plugin import DevicePlugin, Discovery, Health, ProbedDevice
from kunlun.device.plugins.smi_output import dtypes_for_name, parse_float, parse_table_rows
from kunlun.device.plugins.smi_topology import attach_topology
from kunlun.device.tools import ToolRunner
from kunlun.errors import ToolError

#: Data-sheet dtypes (MetaX product pages: 曦云 C500 / C550 FP32/TF32/FP16/BF16/INT8;
#: 曦思 N260 FP32/FP16/BF16/INT8).
_DTYPES = {
    "C500": ["fp32", "bf16", "fp16", "int8"],
    "C550": ["fp32", "bf16", "fp16", "int8"],
    "N260": ["fp32", "bf16", "fp16", "int8"],
}
_BUS = re.compile(r"[0-9a-fA-F]{4,8}:[0-9a-fA-F]{2}:[0-9a-fA-F]{2}\.[0-7]")
_MEMORY = re.compile(r"(\d+)\s*(?:MiB)?\s*/\s*(\d+)\s*MiB", re.IGNORECASE)
_VERSIONS = {
    "driver_version": re.compile(r"Kernel Mode Driver Version:\s*(\S+)"),
    "maca_version": re.compile(r"MACA Version:\s*(\S+)"),
}


def dtypes_for_model(name: str) -> list[str] | None:
    """Supported dtypes of a MetaX GPU from its name (None when the model is unknown)."""
    return dtypes_for_name(_DTYPES, name)


class MetaxPlugin(DevicePlugin):
    device_type = "metax"
    vendor = "MetaX"
    tools = ("mx-smi",)
    visibility_env = "CUDA_VISIBLE_DEVICES"
    runtime_env = ("MACA_PATH", "LD_LIBRARY_PATH")
    torch_device_type = "cuda"
    distributed_backend = "nccl"  # MCCL, under the nccl name
    torch_module = None
    memory_fields = None
    custom_attributes = {"cuda_graphs": bool}
    compute_unit_dtype = "fp16"
    pci_vendor_ids = ("9999",)
    device_nodes = ("/dev/mxcd",)

    def discover(self, tools: ToolRunner) -> Discovery:
        if not tools.available("mx-smi"):
            return Discovery(notes=["mx-smi not found"], tool_found=False)
        devices = parse_mx_smi(tools.run(["mx-smi"]))
        if not devices:
            return Discovery(notes=["mx-smi reports no GPUs"])
        return Discovery(devices, attach_topology(devices, tools, ["mx-smi", "topo", "-m"], "GPU"))


def parse_mx_smi(text: str, command: str = "mx-smi") -> list[ProbedDevice]:
    """Devices from the ``mx-smi`` table; :class:`ToolError` when it has no GPU rows."""
    rows = parse_table_rows(text)
    if not rows:
        if not text.strip():
            return []
        raise ToolError(f"'{command}' output has no GPU rows")
    versions = {k: m.group(1) for k, p in _VERSIONS.items() if (m := p.search(text)) is not None}
    devices: dict[int, ProbedDevice] = {}
    for first, second in rows:
        tokens = first[0].split()
        name = " ".join(tokens[1:]) or "metax"
        device = ProbedDevice("metax", int(tokens[0]), name, health=Health.UNKNOWN)
        device.attributes.update(versions)
        if len(tokens) < 2:
            device.problems.append("mx-smi gives no GPU name")
        bus = _BUS.search(first[1]) if len(first) > 1 else None
        device.bus_id = bus.group().lower() if bus else None
        if len(first) > 2 and first[2]:
            try:
                device.utilization_pct = parse_float(first[2])
            except ValueError as exc:
                device.problems.append(f"utilization: {exc}")
        _second_line(device, second)
        device.supported_dtypes = dtypes_for_model(device.name)
        devices.setdefault(device.index, device)
    return sorted(devices.values(), key=lambda d: d.index)


def _second_line(device: ProbedDevice, cells: list[str] | None) -> None:
    if cells is None or len(cells) < 2:
        device.problems.append("mx-smi row is cut short: memory unknown")
        return
    memory = _MEMORY.search(cells[1])
    if memory is None:
        device.problems.append(f"memory {cells[1]!r} is not USED/TOTAL MiB")
    else:
        device.memory_used_mb, device.memory_total_mb = int(memory[1]), int(memory[2])
    temp = re.search(r"(\d+(?:\.\d+)?)\s*C\b", cells[0])
    power = re.search(r"(\d+(?:\.\d+)?)\s*W\s*/", cells[0])
    device.temperature_c = float(temp[1]) if temp else None
    device.power_w = float(power[1]) if power else None
