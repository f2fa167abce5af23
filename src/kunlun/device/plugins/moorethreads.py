"""Moore Threads (摩尔线程) GPUs (MTT S4000, S5000, ...) through ``mthreads-gmi -q``.

No public sample of ``mthreads-gmi`` output is in ``tests/fixtures`` (only the normalized
S5000 topology, ``topology_output_mthreads_s5000.json``). The parser follows Moore Threads'
"mthreads-gmi 用户手册" (MUSA driver 2.x / 3.x, mthreads-gmi 1.x / 2.x) for the query report
``mthreads-gmi -q``, which copies ``nvidia-smi -q``::

    Driver Version                     : 2.7.0
    Attached GPUs                      : 8
    GPU 00000000:4F:00.0
        Index                          : 0
        GPU UUID                       : 4dac4a5e-...
        Product Name                   : MTT S4000
        Memory Usage
            Total                      : 49152MiB
            Used                       : 2MiB
        Utilization
            Gpu                        : 0%
        Temperature
            Gpu                        : 41C
        Power Readings
            Power Draw                 : 45.51W

The report has no health word unless a ``Health``/``State`` field is present, so health is
usually unknown (treated as OK). ``mthreads-gmi topo -m``, where the installed version has
it, gives the ``topo -m`` matrix (``MTLink`` is a fast link).

torch: the extension is ``torch_musa`` (device ``musa``), devices selected with
``MUSA_VISIBLE_DEVICES``.
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

_GPU = re.compile(r"^GPU\s+([0-9A-Fa-f]+:[0-9A-Fa-f]{2}:[0-9A-Fa-f]{2}\.[0-7])$")
#: Data-sheet dtypes (Moore Threads product pages: MTT S4000 FP32/TF32/FP16/BF16/INT8;
#: MTT S5000 adds FP8).
_DTYPES = {
    "S4000": ["fp32", "bf16", "fp16", "int8"],
    "S5000": ["fp32", "bf16", "fp16", "fp8_e4m3", "fp8_e5m2", "int8"],
}


def dtypes_for_model(name: str) -> list[str] | None:
    """Supported dtypes of a Moore Threads GPU from its product name (None when unknown)."""
    return dtypes_for_name(_DTYPES, name)


class MooreThreadsPlugin(DevicePlugin):
    device_type = "moorethreads"
    vendor = "Moore Threads"
    tools = ("mthreads-gmi",)
    visibility_env = "MUSA_VISIBLE_DEVICES"
    runtime_env = ("MUSA_HOME", "MUSA_PATH", "LD_LIBRARY_PATH")
    torch_device_type = "musa"
    distributed_backend = "mccl"
    torch_module = "torch_musa"
    memory_fields = None
    custom_attributes = {"musa_graphs": bool}
    compute_unit_dtype = "fp16"
    pci_vendor_ids = ("1ed5",)
    device_nodes = ("/dev/mtgpu.[0-9]*",)

    def discover(self, tools: ToolRunner) -> Discovery:
        if not tools.available("mthreads-gmi"):
            return Discovery(notes=["mthreads-gmi not found"], tool_found=False)
        devices = parse_gmi_query(tools.run(["mthreads-gmi", "-q"]))
        if not devices:
            return Discovery(notes=["mthreads-gmi reports no GPUs"])
        notes = attach_topology(devices, tools, ["mthreads-gmi", "topo", "-m"], "GPU")
        return Discovery(devices, notes)


def parse_gmi_query(text: str, command: str = "mthreads-gmi -q") -> list[ProbedDevice]:
    """Devices from ``mthreads-gmi -q``; :class:`ToolError` when there is no GPU block."""
    blocks = parse_report(text, _GPU)
    if not blocks:
        if not text.strip():
            return []
        raise ToolError(f"'{command}' output has no 'GPU <bus id>' blocks")
    devices: dict[int, ProbedDevice] = {}
    for position, block in enumerate(blocks):
        device = _from_block(position, block)
        devices.setdefault(device.index, device)
    return sorted(devices.values(), key=lambda d: d.index)


def _from_block(position: int, block: ReportBlock) -> ProbedDevice:
    name = block.get("Product Name")
    device = ProbedDevice("moorethreads", position, name or "moorethreads")
    raw_index = block.get("Index")
    if raw_index is not None:
        try:
            device.index = int(raw_index)
        except ValueError:
            device.problems.append(f"index {raw_index!r} is not a number; using {position}")
    if is_missing(name):
        device.name = "moorethreads"
        device.problems.append("mthreads-gmi gives no Product Name")
    device.bus_id = normalize_bus_id(block.header.group(1))
    uuid = block.get("GPU UUID", "UUID")
    device.uuid = None if is_missing(uuid) else uuid
    set_parsed(device, "memory_total_mb", block.get("Memory Usage/Total"), parse_mib)
    set_parsed(device, "memory_used_mb", block.get("Memory Usage/Used"), parse_mib)
    set_parsed(device, "utilization_pct", block.get("Utilization/Gpu"), parse_float)
    set_parsed(device, "temperature_c", block.get("Temperature/Gpu"), parse_float)
    set_parsed(device, "power_w", block.leaf("Power Draw"), parse_float)
    if device.memory_total_mb is None:
        device.problems.append("mthreads-gmi gives no memory total")
    word = block.leaf("Health", "State")
    device.health, device.health_detail = health_from_word(word), word
    device.supported_dtypes = dtypes_for_model(device.name)
    if not is_missing(block.top.get("Driver Version")):
        device.attributes["driver_version"] = block.top["Driver Version"]
    return device
