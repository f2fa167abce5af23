"""Cambricon MLUs (MLU370, MLU590, ...) through ``cnmon`` (``mlu-smi`` accepted as its alias).

No public sample of ``cnmon`` output is in ``tests/fixtures``. The parsers follow Cambricon's
"CNMon User Guide" (寒武纪 CNMon 用户手册, cnmon v4.x/v5.x as shipped with MLU370 drivers
4.20 - 5.10):

- ``cnmon info``: a report, one ``Card N`` block per MLU with ``Key : Value`` lines
  (``Product Name``, ``UUID``, ``Driver``, ``MLU Firmware``) and indented sections
  (``Physical Memory Usage`` > ``Total``/``Used``, ``Utilization`` > ``MLU Average``,
  ``Temperature`` > ``Chip``, ``Power`` > ``Usage``);
- ``cnmon`` (the list view): a two-line-per-card table::

      | Card  VF  Name       Firmware |               Bus-Id | Util        Ecc-Error |
      | Fan   Temp      Pwr:Usage/Cap |         Memory-Usage | Mode     Compute-Mode |
      | 0     /   MLU370-X4    v1.1.6 |         0000:3B:00.0 | 0%                  0 |
      |  0%   34C         36 W/ 150 W |     608 MiB/ 23968 MiB | FULL       Default |

The report gives the facts; the list view adds the PCI bus id and the ECC error count
(health: 0 errors OK, more WARNING, with ``Ecc-Error N`` as the raw word), and stands in for
the report when ``cnmon info`` fails. CNMon documents no peer-to-peer query (MLU-Link
topology comes from the separate ``cntopo`` tool), so ``p2p_capable`` stays unknown and a
declared ``p2p_enabled`` is kept as declared.

Cambricon states compute in INT8 TOPS; the torch extension is ``torch_mlu`` (device ``mlu``).
"""

from __future__ import annotations

import re
from types import MappingProxyType

from kunlun.device.plugin import DevicePlugin, Discovery, Health, ProbedDevice
from kunlun.device.plugins.smi_output import (
    ReportBlock,
    dtypes_for_name,
    is_missing,
    parse_float,
    parse_mib,
    parse_report,
    parse_table_rows,
)
from kunlun.device.tools import ToolRunner
from kunlun.errors import ToolError

_CARD = re.compile(r"^Card\s+(\d+)\s*$", re.IGNORECASE)
#: Data-sheet dtypes by chip family (Cambricon product pages: MLU370-S4/X4/X8 list
#: INT4/INT8/INT16/FP16/BF16/FP32; MLU590 FP32/TF32/FP16/BF16/INT8; MLU270/MLU220 list
#: INT4/INT8/INT16/FP16/FP32).
_DTYPES = {
    "MLU370": ["fp32", "bf16", "fp16", "int8", "int4"],
    "MLU590": ["fp32", "bf16", "fp16", "int8"],
    "MLU270": ["fp32", "fp16", "int8", "int4"],
    "MLU220": ["fp32", "fp16", "int8", "int4"],
}


def dtypes_for_model(name: str) -> list[str] | None:
    """Supported dtypes of an MLU from its product name (None when the family is unknown)."""
    return dtypes_for_name(_DTYPES, name)


class CambriconPlugin(DevicePlugin):
    device_type = "cambricon"
    vendor = "Cambricon"
    tools = ("cnmon", "mlu-smi")
    visibility_env = "MLU_VISIBLE_DEVICES"
    runtime_env = ("NEUWARE_HOME", "LD_LIBRARY_PATH")
    torch_device_type = "mlu"
    distributed_backend = "cncl"
    torch_module = "torch_mlu"
    vendor_kernels = MappingProxyType({
        "attention": "flash_attention (torch_mlu_ops)",
        "rmsnorm": "fused_rms_norm (torch_mlu_ops)",
        "rotary": "apply_rotary (torch_mlu_ops)",
        "matmul": "smooth_quant_matmul, weight_only_quant_matmul (torch_mlu_ops)",
    })  # fmt: skip
    memory_fields = ("mlu_memory_mb", "ddr_memory_mb")
    custom_attributes = {"magicmind_opt_level": str, "mlu_stream_priority": str}
    compute_unit_dtype = "int8"
    pci_vendor_ids = ("cabc",)
    device_nodes = ("/dev/cambricon_ctl", "/dev/cambricon_dev[0-9]*")

    def discover(self, tools: ToolRunner) -> Discovery:
        tool = next((t for t in self.tools if tools.available(t)), None)
        if tool is None:
            return Discovery(notes=["neither cnmon nor mlu-smi found"], tool_found=False)
        notes = ["p2p unknown: cnmon has no peer-to-peer query"]
        try:
            devices = parse_cnmon_info(tools.run([tool, "info"]), f"{tool} info")
            info_error = None
        except ToolError as exc:
            devices, info_error = [], exc
        try:
            rows = parse_cnmon_list(tools.run([tool]), tool)
        except ToolError as exc:
            if info_error is not None:
                raise info_error from None
            notes.append(f"no bus ids or ECC counts: {exc.message}")
            rows = {}
        if info_error is not None:
            notes.append(f"details unknown, using the list view: {info_error.message}")
            devices = list(rows.values())
        else:
            _merge_list_view(devices, rows)
        for device in devices:
            device.supported_dtypes = dtypes_for_model(device.name)
        return Discovery(devices, notes)


def parse_cnmon_info(text: str, command: str = "cnmon info") -> list[ProbedDevice]:
    """Devices from ``cnmon info``; :class:`ToolError` when it has no ``Card N`` block."""
    blocks = parse_report(text, _CARD)
    if not blocks:
        if not text.strip():
            return []
        raise ToolError(f"'{command}' output has no 'Card N' blocks")
    devices: dict[int, ProbedDevice] = {}
    for block in blocks:
        device = _from_info_block(block)
        devices.setdefault(device.index, device)
    return list(devices.values())


def _from_info_block(block: ReportBlock) -> ProbedDevice:
    index = int(block.header.group(1))
    name = block.get("Product Name")
    device = ProbedDevice("cambricon", index, name or "cambricon")
    if is_missing(name):
        device.name = "cambricon"
        device.problems.append("cnmon gives no Product Name")
    uuid = block.get("UUID")
    device.uuid = None if is_missing(uuid) else uuid
    for attr, paths, parse in (
        ("memory_total_mb", ("Physical Memory Usage/Total",), parse_mib),
        ("memory_used_mb", ("Physical Memory Usage/Used",), parse_mib),
        ("utilization_pct", ("Utilization/MLU Average",), parse_float),
        ("temperature_c", ("Temperature/Chip", "Temperature/Board"), parse_float),
        ("power_w", ("Power/Usage",), parse_float),
    ):
        try:
            setattr(device, attr, parse(block.get(*paths)))
        except ValueError as exc:
            device.problems.append(f"{attr}: {exc}")
    if device.memory_total_mb is None:
        device.problems.append("cnmon gives no physical memory total")
    for key, attr in (
        ("Driver", "driver_version"),
        ("MLU Firmware", "firmware"),
        ("Product Type", "chip"),
    ):
        value = block.get(key)
        if not is_missing(value):
            device.attributes[attr] = str(value)
    return device


_BUS = re.compile(r"[0-9a-fA-F]{4,8}:[0-9a-fA-F]{2}:[0-9a-fA-F]{2}\.[0-7]")
_MEMORY = re.compile(r"(\d+)\s*MiB\s*/\s*(\d+)\s*MiB", re.IGNORECASE)


def parse_cnmon_list(text: str, command: str = "cnmon") -> dict[int, ProbedDevice]:
    """Devices of the ``cnmon`` list view, by card index (health from the ECC count)."""
    rows = parse_table_rows(text)
    if not rows and text.strip():
        raise ToolError(f"'{command}' output has no card rows")
    devices: dict[int, ProbedDevice] = {}
    for first, second in rows:
        tokens = first[0].split()
        index = int(tokens[0])
        name = next((t for t in tokens[1:] if t.upper().startswith("MLU")), "cambricon")
        device = ProbedDevice("cambricon", index, name)
        bus = _BUS.search(first[1]) if len(first) > 1 else None
        if bus is not None:
            device.bus_id = bus.group().lower()
        if len(first) > 2:
            _list_util_and_ecc(device, first[2].split())
        if second is None or len(second) < 2:
            device.problems.append("cnmon list row is cut short")
        else:
            memory = _MEMORY.search(second[1])
            if memory is not None:
                device.memory_used_mb = int(memory.group(1))
                device.memory_total_mb = int(memory.group(2))
            temp = re.search(r"(\d+)\s*C\b", second[0])
            device.temperature_c = float(temp.group(1)) if temp else None
        devices.setdefault(index, device)
    return devices


def _list_util_and_ecc(device: ProbedDevice, cell: list[str]) -> None:
    if cell and cell[0].endswith("%"):
        try:
            device.utilization_pct = parse_float(cell[0])
        except ValueError as exc:
            device.problems.append(f"utilization: {exc}")
    if len(cell) >= 2:
        try:
            errors = int(cell[-1])
        except ValueError:
            device.health, device.health_detail = Health.UNKNOWN, f"Ecc-Error {cell[-1]}"
            return
        device.health = Health.OK if errors == 0 else Health.WARNING
        device.health_detail = None if errors == 0 else f"Ecc-Error {errors}"


def _merge_list_view(devices: list[ProbedDevice], rows: dict[int, ProbedDevice]) -> None:
    for device in devices:
        row = rows.get(device.index)
        if row is None:
            continue
        device.bus_id = device.bus_id or row.bus_id
        device.health, device.health_detail = row.health, row.health_detail
        if device.utilization_pct is None:
            device.utilization_pct = row.utilization_pct
