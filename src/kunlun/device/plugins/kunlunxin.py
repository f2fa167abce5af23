"""Kunlunxin (昆仑芯) XPUs (R200, R300, P800) through ``xpu-smi -q``.

No public sample of ``xpu-smi`` output is in ``tests/fixtures``. The parser follows
Kunlunxin's "xpu-smi 使用说明" (XPU driver 4.x / 5.x; P800 hosts with XPU-RT 5.0) for the
query report ``xpu-smi -q``, which copies ``nvidia-smi -q``::

    Driver Version                        : 5.0.21.21
    XPU-RT Version                        : 5.0.21
    Attached XPUs                         : 8
    XPU 00000000:52:00.0
        Product Name                      : P800 OAM
        XPU UUID                          : GPU-9a3f4c...
        Minor Number                      : 0
        Memory Usage
            Total                         : 98304 MiB
            Used                          : 0 MiB
        Utilization
            Xpu                           : 0 %
        Temperature
            XPU Current Temp              : 40 C
        Power Readings
            Power Draw                    : 85.00 W

Blocks come in device-index order (the index is the block's position; ``Minor Number`` is
the ``/dev/xpuN`` node and is kept as an attribute). The report has no health word unless a
``Health``/``State`` field is present, so health is usually unknown (treated as OK).
``xpu-smi topo -m``, where the installed version has it, gives the ``topo -m`` matrix.

torch: Kunlunxin's PyTorch extension is ``torch_xmlir`` (XMLIR; ``import torch_xmlir``
registers the XPU with torch). Device type ``xpu`` is what it registers on the R200/R300
stacks; the P800 stack in "CUDA-compatible mode" exposes the same cards as ``cuda`` devices,
a deployment choice an operator makes outside this plugin.
"""

from __future__ import annotations

import re

from kunlun.device.plugin import DevicePlugin, Discovery, ProbedDevice
from kunlun.device.plugins.nvidia import normalize_bus_id
from kunlun.device.plugins.smi_output import (
    ReportBlock,
    dtypes_for_name,
    health_from_word,
    is_missing,
    parse_float,
    parse_mib,
    parse_report,
    set_parsed,
)
from kunlun.device.plugins.smi_topology import attach_topology
from kunlun.device.tools import ToolRunner
from kunlun.errors import ToolError

_XPU = re.compile(r"^XPU\s+([0-9A-Fa-f]+:[0-9A-Fa-f]{2}:[0-9A-Fa-f]{2}\.[0-7])$")
#: Data-sheet dtypes (Kunlunxin product pages: R200 INT8/FP16/FP32 (XPU-R); P800 adds BF16
#: (XPU-P)).
_DTYPES = {
    "R200": ["fp32", "fp16", "int8"],
    "P800": ["fp32", "bf16", "fp16", "int8"],
}


def dtypes_for_model(name: str) -> list[str] | None:
    """Supported dtypes of a Kunlunxin XPU from its product name (None when unknown)."""
    return dtypes_for_name(_DTYPES, name)


class KunlunxinPlugin(DevicePlugin):
    device_type = "kunlunxin"
    vendor = "Kunlunxin"
    tools = ("xpu-smi",)
    visibility_env = "XPU_VISIBLE_DEVICES"
    runtime_env = ("LD_LIBRARY_PATH",)
    torch_device_type = "xpu"
    distributed_backend = "bkcl"
    torch_module = "torch_xmlir"
    memory_fields = None
    custom_attributes = {"xpu_graph_enabled": bool}
    compute_unit_dtype = "fp16"
    pci_vendor_ids = ("1d22",)
    device_nodes = ("/dev/xpuctrl", "/dev/xpu[0-9]*")

    def discover(self, tools: ToolRunner) -> Discovery:
        if not tools.available("xpu-smi"):
            return Discovery(notes=["xpu-smi not found"], tool_found=False)
        devices = parse_xpu_query(tools.run(["xpu-smi", "-q"]))
        if not devices:
            return Discovery(notes=["xpu-smi reports no XPUs"])
        return Discovery(devices, attach_topology(devices, tools, ["xpu-smi", "topo", "-m"], "XPU"))


def parse_xpu_query(text: str, command: str = "xpu-smi -q") -> list[ProbedDevice]:
    """Devices from ``xpu-smi -q``; :class:`ToolError` when there is no ``XPU <bus>`` block."""
    blocks = parse_report(text, _XPU)
    if not blocks:
        if not text.strip():
            return []
        raise ToolError(f"'{command}' output has no 'XPU <bus id>' blocks")
    return [_from_block(index, block) for index, block in enumerate(blocks)]


def _from_block(index: int, block: ReportBlock) -> ProbedDevice:
    name = block.get("Product Name")
    device = ProbedDevice("kunlunxin", index, name or "kunlunxin")
    if is_missing(name):
        device.name = "kunlunxin"
        device.problems.append("xpu-smi gives no Product Name")
    device.bus_id = normalize_bus_id(block.header.group(1))
    uuid = block.get("XPU UUID", "UUID")
    device.uuid = None if is_missing(uuid) else uuid
    set_parsed(device, "memory_total_mb", block.get("Memory Usage/Total"), parse_mib)
    set_parsed(device, "memory_used_mb", block.get("Memory Usage/Used"), parse_mib)
    set_parsed(device, "utilization_pct", block.get("Utilization/Xpu"), parse_float)
    set_parsed(device, "temperature_c", block.leaf("XPU Current Temp"), parse_float)
    set_parsed(device, "power_w", block.leaf("Power Draw"), parse_float)
    if device.memory_total_mb is None:
        device.problems.append("xpu-smi gives no memory total")
    word = block.leaf("Health", "State")
    device.health, device.health_detail = health_from_word(word), word
    device.supported_dtypes = dtypes_for_model(device.name)
    for key, attr in (("Driver Version", "driver_version"), ("XPU-RT Version", "runtime_version")):
        if not is_missing(block.top.get(key)):
            device.attributes[attr] = block.top[key]
    minor = block.get("Minor Number")
    if not is_missing(minor):
        device.attributes["minor_number"] = str(minor)
    return device
