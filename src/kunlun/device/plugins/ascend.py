"""Huawei Ascend NPUs through ``npu-smi``.

Three commands, all text:

- ``npu-smi info``: the main table. Each chip is a pair of rows, ``NPU Name | Health |
  Power(W) Temp(C) Hugepages-Usage(page)`` and ``Chip [Device] | Bus-Id | AICore(%)
  Memory-Usage(MB) [HBM-Usage(MB)]``; the sub-columns of the third cell are read by the
  header's names, so tables with fewer or more of them still parse. A process table may
  follow; it is ignored. Recorded samples: npu-smi 24.1.RC2 (Atlas 800 training server 9010,
  8 x 910A) and 21.0.4 (Atlas 800 inference server 3000, 4 x 310).
- ``npu-smi info -m``: ``NPU ID  Chip ID  Chip Logic ID  Chip Name``. A device's index is its
  Chip Logic ID (what ``ASCEND_RT_VISIBLE_DEVICES`` and torch_npu count); a row whose logic id
  is ``-`` (the board's Mcu) is not a device.
- ``npu-smi info -t topo`` (optional; training products only): format from Huawei's "npu-smi
  command reference" (Atlas 800 training server, npu-smi 24.1.RC2, section "info -t topo"),
  no recorded sample. The layout of ``nvidia-smi topo -m``: a header of ``NPU0 .. NPUn`` and
  ``CPU Affinity``, one row per NPU (its Chip Logic ID) of ``X`` / ``HCCS`` / ``PIX`` /
  ``PXB`` / ``PHB`` / ``SYS`` / ``NA`` then a ``Legend:`` block. Parsed by the shared
  :mod:`~kunlun.device.plugins.smi_topology`: distances 0 self, 5 HCCS (HCCS_SW, SIO),
  10 PIX, 20 PXB, 30 PHB, 40 NODE, 50 SYS; peer-to-peer when any link to another NPU is
  HCCS, PIX or PXB. ``NA`` (unknown relationship) leaves that NPU's row unknown, with a note.

Health: ``OK`` is OK, ``Warning`` Degraded, any other word (``Alarm``, ``Critical``...)
Unhealthy with the raw word kept. Memory is the HBM total when the table has a non-zero one,
else the Memory-Usage total (the 310 has no HBM).
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TypeVar

from kunlun.device.plugin import DevicePlugin, Discovery, Health, ProbedDevice
from kunlun.device.plugins.smi_topology import attach_topology
from kunlun.device.tools import ToolRunner
from kunlun.errors import ToolError

INFO_ARGV = ["npu-smi", "info"]
MAPPING_ARGV = ["npu-smi", "info", "-m"]
TOPO_ARGV = ["npu-smi", "info", "-t", "topo"]

_BUS_ID = re.compile(r"^[0-9A-Fa-f]{4,8}:[0-9A-Fa-f]{2}:[0-9A-Fa-f]{2}\.[0-7]$")
_VALUE = re.compile(r"(\S+)\s*/\s*(\S+)|(\S+)")
_MISSING = {"NA", "N/A", "-", "--"}
T = TypeVar("T")


# --- dtypes -------------------------------------------------------------------------------

# What CANN computes on each chip family (CANN operator specifications, as best known):
# the AI Core's cube unit does fp16 and int8 on every family; fp32 runs on the vector unit
# (and on the cube by conversion); bf16 arrived with the 910B (Atlas A2) and is kept on the
# 910_93 (Atlas A3). The 310 / 310P / 310B inference chips have no bf16.
_TRAINING_A2 = ["fp32", "bf16", "fp16", "int8"]
_TRAINING_910 = ["fp32", "fp16", "int8"]
_INFERENCE_310 = ["fp32", "fp16", "int8"]


def ascend_dtypes(name: str) -> list[str] | None:
    """Supported dtypes of a chip from its name (``Ascend 910B3``, ``310P3``, ``MiniD``)."""
    model = name.strip().lower().removeprefix("ascend").strip()
    if model.startswith(("910b", "910_93", "910c")):
        return list(_TRAINING_A2)
    if model.startswith("910"):
        return list(_TRAINING_910)
    if model.startswith(("310", "mini")):  # "Mini" is the 310's code name
        return list(_INFERENCE_310)
    return None


def display_name(chip_name: str | None, table_name: str | None) -> str:
    """``Ascend 910A`` from the mapping, or ``Ascend <model>`` from the main table."""
    if chip_name and chip_name.lower().startswith("ascend"):
        return chip_name
    if table_name and re.match(r"[0-9]{3}", table_name):
        return f"Ascend {table_name}"
    return chip_name or table_name or "Ascend NPU"


# --- npu-smi info ---------------------------------------------------------------------------


@dataclass
class ChipRow:
    """One chip of the main table: its two rows, the third cell's values by column name."""

    npu_id: int
    chip_id: int
    name: str
    health: str
    bus_id: str | None
    values: dict[str, str] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)


@dataclass
class InfoTable:
    version: str | None
    chips: list[ChipRow]
    notes: list[str]


def parse_info(text: str) -> InfoTable:
    """The chips of ``npu-smi info``; raises :class:`ToolError` when there is no table."""
    command = " ".join(INFO_ARGV)
    lines = text.splitlines()
    start = next(
        (i for i, line in enumerate(lines) if _is_row(line) and "Health" in line and "NPU" in line),
        None,
    )
    if start is None or start + 1 >= len(lines):
        raise ToolError(f"'{command}' printed no device table (no 'NPU ... | Health' header)")
    names1 = _cells(lines[start])[2].split() if len(_cells(lines[start])) > 2 else []
    header2 = _cells(lines[start + 1])
    names2 = header2[2].split() if len(header2) > 2 else []
    version = re.search(r"npu-smi\s+(\S+)", text)
    table = InfoTable(version.group(1) if version else None, [], [])
    current: tuple[int, str, str, dict[str, str]] | None = None
    seen: set[tuple[int, int]] = set()
    for number, line in enumerate(lines[start + 2 :], start + 3):
        if "Process id" in line or "Process name" in line:
            break  # the process table follows the device table
        cells = _cells(line) if _is_row(line) else []
        if len(cells) < 3:
            continue
        if _BUS_ID.match(cells[1]):
            chip = _chip_row(cells, current, names2, number, table.notes)
            if chip is None:
                continue
            if (chip.npu_id, chip.chip_id) in seen:
                table.notes.append(
                    f"'{command}' line {number}: NPU {chip.npu_id} chip "
                    f"{chip.chip_id} listed twice; the first row is kept"
                )
                continue
            seen.add((chip.npu_id, chip.chip_id))
            table.chips.append(chip)
            continue
        first = cells[0].split()
        if first and _is_int(first[0]) and cells[1]:
            values, problem = _values(cells[2], names1)
            if problem:
                values["_problem"] = f"line {number}: {problem}"
            current = (int(first[0]), " ".join(first[1:]), cells[1].split()[0], values)
    return table


def _is_int(text: str) -> bool:
    """ASCII digits only (``str.isdigit`` accepts ``²``, which ``int`` refuses)."""
    return re.fullmatch(r"[0-9]{1,12}", text) is not None


def _is_row(line: str) -> bool:
    return line.lstrip().startswith("|")


def _cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]


def _values(cell: str, names: list[str]) -> tuple[dict[str, str], str | None]:
    """The third cell's values by column name; a count mismatch keeps none of them."""
    found = [
        "/".join(g for g in m.groups()[:2]) if m.group(1) else m.group(3)
        for m in _VALUE.finditer(cell)
    ]
    if len(found) != len(names):
        return {}, f"{len(found)} values under the {len(names)} columns {' '.join(names)}"
    return dict(zip(names, found, strict=True)), None


def _chip_row(
    cells: list[str],
    current: tuple[int, str, str, dict[str, str]] | None,
    names: list[str],
    number: int,
    notes: list[str],
) -> ChipRow | None:
    command = " ".join(INFO_ARGV)
    first = cells[0].split()
    if current is None or not first or not _is_int(first[0]):
        notes.append(f"'{command}' line {number}: a chip row with no NPU row above it; skipped")
        return None
    npu_id, name, health, values1 = current
    values2, problem = _values(cells[2], names)
    chip = ChipRow(npu_id, int(first[0]), name, health, cells[1], {**values1, **values2})
    if len(first) > 1 and _is_int(first[1]):
        chip.values["_device_id"] = first[1]
    for p in (values1.get("_problem"), f"line {number}: {problem}" if problem else None):
        if p:
            chip.problems.append(f"'{command}' {p}")
    return chip


def _lookup(values: dict[str, str], prefix: str) -> tuple[str, str] | None:
    for name, value in values.items():
        if name.lower().startswith(prefix):
            return name, value
    return None


def _number(chip: ChipRow, prefix: str) -> float | None:
    found = _lookup(chip.values, prefix)
    if found is None or found[1] in _MISSING:
        return None
    try:
        value = float(found[1])
    except ValueError:
        value = math.nan
    if math.isfinite(value) and value >= 0:
        return value
    chip.problems.append(
        f"'npu-smi info' NPU {chip.npu_id} chip {chip.chip_id}: {found[0]} is {found[1]!r}, "
        "not a number"
    )
    return None


def _usage(chip: ChipRow, prefix: str) -> tuple[int, int] | None:
    """``used / total`` of a memory column, in MB."""
    found = _lookup(chip.values, prefix)
    if found is None:
        return None
    used, _, total = found[1].partition("/")
    if _is_int(used.strip()) and _is_int(total.strip()):
        return int(used), int(total)
    chip.problems.append(
        f"'npu-smi info' NPU {chip.npu_id} chip {chip.chip_id}: {found[0]} is {found[1]!r}, "
        "not 'used / total'"
    )
    return None


def health_of(word: str) -> Health:
    if word == "OK":
        return Health.OK
    if word == "Warning":
        return Health.WARNING
    return Health.UNHEALTHY


# --- npu-smi info -m --------------------------------------------------------------------------


@dataclass(frozen=True)
class MappedChip:
    npu_id: int
    chip_id: int
    logic_id: int
    chip_name: str


def parse_mapping(text: str) -> tuple[list[MappedChip], list[str]]:
    """Chips with a logic id (the Mcu row is not one) and notes on rows that did not parse."""
    command = " ".join(MAPPING_ARGV)
    lines = text.splitlines()
    start = next(
        (i for i, line in enumerate(lines) if "NPU ID" in line and "Chip Logic ID" in line), None
    )
    if start is None:
        raise ToolError(f"'{command}' printed no 'NPU ID ... Chip Logic ID' header")
    names = re.split(r"\s{2,}", lines[start].strip())
    chips: list[MappedChip] = []
    notes: list[str] = []
    seen: set[int] = set()
    for number, line in enumerate(lines[start + 1 :], start + 2):
        if not line.strip():
            continue
        parts = re.split(r"\s{2,}", line.strip())
        if len(parts) != len(names):
            parts = line.split(None, len(names) - 1)
        row = dict(zip(names, parts, strict=False))
        npu, chip, logic = row.get("NPU ID", ""), row.get("Chip ID", ""), row.get("Chip Logic ID")
        if logic == "-":
            continue  # the Mcu: a board controller, not a device
        if not (_is_int(npu) and _is_int(chip) and logic and _is_int(logic)):
            notes.append(f"'{command}' line {number} did not parse: {line.strip()[:80]!r}")
            continue
        if int(logic) in seen:
            notes.append(f"'{command}' line {number}: logic id {logic} listed twice; skipped")
            continue
        seen.add(int(logic))
        chips.append(MappedChip(int(npu), int(chip), int(logic), row.get("Chip Name", "").strip()))
    if not chips:
        raise ToolError(f"'{command}' lists no chip with a logic id")
    return chips, notes


# --- the plugin -------------------------------------------------------------------------------


class AscendPlugin(DevicePlugin):
    """Huawei Ascend NPUs (see the module docstring)."""

    device_type = "ascend"
    vendor = "Huawei"
    tools = ("npu-smi",)
    visibility_env = "ASCEND_RT_VISIBLE_DEVICES"
    runtime_env = (
        "ASCEND_HOME_PATH",
        "ASCEND_TOOLKIT_HOME",
        "ASCEND_OPP_PATH",
        "ASCEND_AICPU_PATH",
        "LD_LIBRARY_PATH",
    )
    torch_device_type = "npu"
    distributed_backend = "hccl"
    torch_module = "torch_npu"
    vendor_kernels = MappingProxyType({
        "attention": "npu_fusion_attention (torch_npu)",
        "rmsnorm": "npu_rms_norm (torch_npu)",
        "rotary": "npu_rotary_mul (torch_npu)",
        "matmul": "npu_quant_matmul, npu_weight_quant_batchmatmul (torch_npu)",
    })  # fmt: skip
    memory_fields = ("hbm_memory_mb", "sys_memory_mb")
    custom_attributes = {"aclnn_fusion_enabled": bool}
    compute_unit_dtype = "fp16"
    pci_vendor_ids = ("19e5",)
    device_nodes = ("/dev/davinci*", "/dev/davinci_manager", "/dev/devmm_svm", "/dev/hisi_hdc")

    def discover(self, tools: ToolRunner) -> Discovery:
        if not tools.available("npu-smi"):
            return Discovery(
                notes=["npu-smi not found (the Ascend driver is not installed)"],
                tool_found=False,
            )
        table, table_error = _attempt(lambda: parse_info(tools.run(INFO_ARGV)))
        mapping, mapping_error = _attempt(lambda: parse_mapping(tools.run(MAPPING_ARGV)))
        if table is None and mapping is None:
            raise ToolError(f"{table_error}; {mapping_error}")
        notes = (table.notes if table else []) + (mapping[1] if mapping else [])
        if mapping is not None:
            devices = _by_mapping(table, table_error, mapping[0], notes)
        else:
            assert table is not None
            devices = _by_row_order(table, str(mapping_error))
        if not devices:
            raise ToolError("'npu-smi info' lists no chips and 'npu-smi info -m' gave none")
        notes += attach_topology(devices, tools, TOPO_ARGV, prefix="NPU")
        return Discovery(devices, notes)


def _attempt(work: Callable[[], T]) -> tuple[T | None, str | None]:
    """``(result, None)``, or ``(None, message)`` when ``work`` raises :class:`ToolError`."""
    try:
        return work(), None
    except ToolError as exc:
        return None, exc.message


def _by_mapping(
    table: InfoTable | None, table_error: str | None, mapped: list[MappedChip], notes: list[str]
) -> list[ProbedDevice]:
    rows = {(c.npu_id, c.chip_id): c for c in (table.chips if table else [])}
    devices = []
    for entry in sorted(mapped, key=lambda m: m.logic_id):
        row = rows.pop((entry.npu_id, entry.chip_id), None)
        if row is None:
            device = ProbedDevice(
                "ascend",
                entry.logic_id,
                display_name(entry.chip_name, None),
                supported_dtypes=ascend_dtypes(entry.chip_name),
            )
            why = table_error or (
                f"'npu-smi info' has no row for NPU {entry.npu_id} chip {entry.chip_id}"
            )
            device.problems.append(f"no health, memory or bus id: {why}")
        else:
            device = _device(row, entry.logic_id, entry.chip_name, table)
        device.attributes.update(npu_id=str(entry.npu_id), chip_id=str(entry.chip_id))
        if entry.chip_name:
            device.attributes["chip_name"] = entry.chip_name
        devices.append(device)
    for row in rows.values():
        notes.append(
            f"'npu-smi info' lists NPU {row.npu_id} chip {row.chip_id} but 'npu-smi info -m' "
            "gives it no logic id; not listed"
        )
    return devices


def _by_row_order(table: InfoTable, mapping_error: str) -> list[ProbedDevice]:
    devices = []
    for position, row in enumerate(table.chips):
        device = _device(row, position, None, table)
        device.problems.append(f"index is the table's row order: {mapping_error}")
        devices.append(device)
    return devices


def _device(
    row: ChipRow, index: int, chip_name: str | None, table: InfoTable | None
) -> ProbedDevice:
    name = display_name(chip_name, row.name if row.name not in ("", "xxx") else None)
    device = ProbedDevice(
        device_type="ascend",
        index=index,
        name=name,
        bus_id=row.bus_id,
        utilization_pct=_number(row, "aicore"),
        temperature_c=_number(row, "temp"),
        power_w=_number(row, "power"),
        health=health_of(row.health),
        health_detail=row.health,
        supported_dtypes=ascend_dtypes(chip_name or name),
    )
    hbm = _usage(row, "hbm-usage")
    ddr = _usage(row, "memory-usage")
    chosen = hbm if hbm and hbm[1] > 0 else ddr
    if chosen and chosen[1] > 0:
        device.memory_used_mb, device.memory_total_mb = chosen
    else:
        row.problems.append(
            f"memory total unknown: 'npu-smi info' NPU {row.npu_id} chip {row.chip_id} "
            "has no HBM-Usage or Memory-Usage total"
        )
    if ddr and hbm and hbm[1] > 0:
        device.attributes["memory_usage_total_mb"] = str(ddr[1])
    if table and table.version:
        device.attributes["npu_smi_version"] = table.version
    if "_device_id" in row.values:
        device.attributes["device_id"] = row.values["_device_id"]
    device.problems = row.problems
    return device
