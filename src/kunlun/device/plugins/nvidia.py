"""NVIDIA GPUs: NVML through ``pynvml`` when importable, else ``nvidia-smi``.

Sources, in order:

1. NVML (``pip install nvidia-ml-py``, imported as ``pynvml``), when importable and not
   replaying: names, memory, utilization, compute capability, and the topology from
   ``nvmlDeviceGetP2PStatus`` (NVLink) and ``nvmlDeviceGetTopologyCommonAncestor`` (whose
   levels 10..50 are exactly Kunlun's PCIe/NUMA distances). If NVML fails, ``nvidia-smi``.
2. ``nvidia-smi --query-gpu=... --format=csv,noheader,nounits`` (one CSV line per GPU; a field
   the GPU does not report reads ``[N/A]`` or ``[Not Supported]`` and becomes ``None``) and
   ``nvidia-smi topo -m`` (see :mod:`kunlun.device.plugins.smi_topology`).

Supported dtypes follow the compute capability (CUDA C++ Programming Guide, "Compute
Capabilities" and the arithmetic-instruction throughput table): fp32 always; fp16 from 5.3;
int8 (``dp4a``) from 6.1; bf16 from 8.0 (Ampere); fp8 from 8.9 (Ada, Hopper).

The CSV parser is shared with CUDA-compatible tools that copy the query interface (Iluvatar's
``ixsmi``): :func:`parse_gpu_query` also accepts values with units (``16384 MiB``, ``0 %``).
"""

from __future__ import annotations

import csv
import re
from types import ModuleType
from typing import Any

from kunlun.device.plugin import DevicePlugin, Discovery, Health, ProbedDevice
from kunlun.device.plugins.smi_output import is_missing, parse_float, parse_mib
from kunlun.device.plugins.smi_topology import FAST_LINK_DISTANCE, attach_topology
from kunlun.device.tools import ToolRunner
from kunlun.errors import ToolError

QUERY_FIELDS = (
    "index",
    "name",
    "pci.bus_id",
    "uuid",
    "memory.total",
    "memory.used",
    "utilization.gpu",
    "temperature.gpu",
    "power.draw",
    "compute_cap",
)
#: Field words that mean the GPU itself is in trouble, and what they mean for health.
_FAULT_WORDS = {
    "[gpu is lost]": Health.UNHEALTHY,
    "[gpu requires reset]": Health.UNHEALTHY,
    "[unknown error]": Health.WARNING,
}


def query_argv(tool: str, fields: tuple[str, ...]) -> list[str]:
    """The ``--query-gpu`` command line for ``fields``."""
    return [tool, f"--query-gpu={','.join(fields)}", "--format=csv,noheader,nounits"]


def dtypes_for_compute_cap(compute_cap: str | None) -> list[str] | None:
    """Supported dtypes for a CUDA compute capability such as ``"8.9"`` (None if unknown)."""
    match = re.match(r"^\s*(\d+)\.(\d+)\s*$", compute_cap or "")
    if match is None:
        return None
    cc = (int(match.group(1)), int(match.group(2)))
    dtypes = ["fp32"]
    if cc >= (8, 0):
        dtypes.append("bf16")
    if cc >= (5, 3):
        dtypes.append("fp16")
    if cc >= (8, 9):
        dtypes += ["fp8_e4m3", "fp8_e5m2"]
    if cc >= (6, 1):
        dtypes.append("int8")
    return dtypes


def normalize_bus_id(value: str | None) -> str | None:
    """``00000000:0E:00.0`` -> ``0000:0e:00.0`` (the 4-digit-domain form Linux uses)."""
    if is_missing(value):
        return None
    assert value is not None
    match = re.match(r"^([0-9a-fA-F]+):([0-9a-fA-F]{2}):([0-9a-fA-F]{2})\.([0-7])$", value.strip())
    if match is None:
        return value.strip()
    domain, bus, dev, fn = match.groups()
    return f"{int(domain, 16):04x}:{bus.lower()}:{dev.lower()}.{fn}"


def parse_gpu_query(
    text: str, fields: tuple[str, ...], device_type: str, command: str
) -> list[ProbedDevice]:
    """Devices from ``--query-gpu`` CSV output with the given ``fields`` (``index`` first).

    A line that is not a device row is skipped; when no line is one, :class:`ToolError`.
    A value that does not parse becomes a problem of its device, not a failure.
    """
    devices: list[ProbedDevice] = []
    skipped: list[str] = []
    lines = [line for line in text.splitlines() if line.strip()]
    try:
        rows = list(csv.reader(lines, skipinitialspace=True))
    except csv.Error as exc:
        raise ToolError(f"'{command}' printed malformed CSV: {exc}") from None
    for row in rows:
        device = _device_from_row([c.strip() for c in row], fields, device_type)
        if device is None:
            skipped.append(",".join(row)[:60])
        else:
            devices.append(device)
    if skipped and not devices:
        raise ToolError(f"'{command}' printed no device rows (first line: {skipped[0]!r})")
    seen: set[int] = set()
    unique = []
    for device in devices:
        if device.index not in seen:
            seen.add(device.index)
            unique.append(device)
    return unique


def _device_from_row(
    row: list[str], fields: tuple[str, ...], device_type: str
) -> ProbedDevice | None:
    values = dict(zip(fields, row, strict=False))
    try:
        index = int(values.get("index", ""))
    except ValueError:
        return None
    if index < 0 or len(row) < 2:
        return None
    name = values.get("name")
    device = ProbedDevice(device_type=device_type, index=index, name=name or device_type)
    if is_missing(name):
        device.name = device_type
        device.problems.append("the tool gave no name")
    if len(row) != len(fields):
        device.problems.append(f"query row has {len(row)} fields, expected {len(fields)}")
    device.health = Health.OK
    for raw in row:
        fault = _FAULT_WORDS.get(raw.lower())
        if fault is not None and (device.health is Health.OK or fault is Health.UNHEALTHY):
            device.health, device.health_detail = fault, raw.strip("[]")
    _set(device, "bus_id", values.get("pci.bus_id"), normalize_bus_id)
    _set(device, "uuid", values.get("uuid"), lambda v: None if is_missing(v) else v)
    _set(device, "memory_total_mb", values.get("memory.total"), parse_mib)
    _set(device, "memory_used_mb", values.get("memory.used"), parse_mib)
    _set(device, "utilization_pct", values.get("utilization.gpu"), parse_float)
    _set(device, "temperature_c", values.get("temperature.gpu"), parse_float)
    _set(device, "power_w", values.get("power.draw"), parse_float)
    compute_cap = values.get("compute_cap")
    if compute_cap is not None and not is_missing(compute_cap):
        device.attributes["compute_cap"] = compute_cap
        device.supported_dtypes = dtypes_for_compute_cap(compute_cap)
        if device.supported_dtypes is None:
            device.problems.append(f"compute_cap {compute_cap!r} is not MAJOR.MINOR")
    return device


def _set(device: ProbedDevice, attr: str, raw: str | None, convert: Any) -> None:
    if raw is None or raw.lower() in _FAULT_WORDS:
        return
    try:
        setattr(device, attr, convert(raw))
    except ValueError as exc:
        device.problems.append(f"{attr}: {exc}")


def load_nvml() -> ModuleType | None:
    """The ``pynvml`` module when it can be imported (nvidia-ml-py), else None."""
    try:
        import pynvml  # noqa: PLC0415 - optional dependency
    except ImportError:
        return None
    return pynvml


class NvidiaPlugin(DevicePlugin):
    device_type = "nvidia"
    vendor = "NVIDIA"
    tools = ("nvidia-smi",)
    visibility_env = "CUDA_VISIBLE_DEVICES"
    runtime_env = ("CUDA_HOME", "CUDA_PATH", "CUDA_MODULE_LOADING", "LD_LIBRARY_PATH")
    torch_device_type = "cuda"
    distributed_backend = "nccl"
    torch_module = None
    memory_fields = None
    custom_attributes = {"cuda_graphs": bool}
    graph_capture = ("torch.cuda.CUDAGraph", "cuda_graphs")
    compute_unit_dtype = "fp16"
    pci_vendor_ids = ("10de",)
    device_nodes = ("/dev/nvidiactl", "/dev/nvidia[0-9]*")

    def discover(self, tools: ToolRunner) -> Discovery:
        notes: list[str] = []
        if not tools.replaying:
            nvml = load_nvml()
            if nvml is not None:
                try:
                    return Discovery(discover_nvml(nvml), notes=["devices from NVML (pynvml)"])
                except Exception as exc:  # noqa: BLE001 - NVML is optional; fall back
                    notes.append(f"NVML failed ({exc!r}); using nvidia-smi")
        if not tools.available("nvidia-smi"):
            return Discovery(notes=[*notes, "nvidia-smi not found"], tool_found=False)
        argv = query_argv("nvidia-smi", QUERY_FIELDS)
        devices = parse_gpu_query(tools.run(argv), QUERY_FIELDS, "nvidia", " ".join(argv[:2]))
        if devices:
            notes += attach_topology(devices, tools, ["nvidia-smi", "topo", "-m"], "GPU")
        else:
            notes.append("nvidia-smi reports no GPUs")
        return Discovery(devices, notes)


#: NVML topology levels (nvmlGpuTopologyLevel_t) -> Kunlun distances; INTERNAL is one board.
_NVML_LEVELS = {0: FAST_LINK_DISTANCE, 10: 10, 20: 20, 30: 30, 40: 40, 50: 50}


def discover_nvml(nvml: Any) -> list[ProbedDevice]:
    """Devices through NVML; raises whatever NVML raises when it cannot start."""
    nvml.nvmlInit()
    try:
        handles = [nvml.nvmlDeviceGetHandleByIndex(i) for i in range(nvml.nvmlDeviceGetCount())]
        devices = [_nvml_device(nvml, i, h) for i, h in enumerate(handles)]
        for i, device in enumerate(devices):
            row = [
                _nvml_distance(nvml, handles[i], handles[j], i == j) for j in range(len(handles))
            ]
            if all(d is not None for d in row):
                device.topology = [d for d in row if d is not None]
                device.p2p_capable = any(d <= 20 for j, d in enumerate(device.topology) if j != i)
        return devices
    finally:
        _try(nvml.nvmlShutdown)


def _nvml_device(nvml: Any, index: int, handle: Any) -> ProbedDevice:
    name = _text(_try(nvml.nvmlDeviceGetName, handle)) or "nvidia"
    device = ProbedDevice("nvidia", index, name, health=Health.OK)
    pci = _try(nvml.nvmlDeviceGetPciInfo, handle)
    device.bus_id = normalize_bus_id(_text(getattr(pci, "busId", None)))
    device.uuid = _text(_try(nvml.nvmlDeviceGetUUID, handle))
    memory = _try(nvml.nvmlDeviceGetMemoryInfo, handle)
    if memory is not None:
        device.memory_total_mb = int(memory.total) // 2**20
        device.memory_used_mb = int(memory.used) // 2**20
    rates = _try(nvml.nvmlDeviceGetUtilizationRates, handle)
    device.utilization_pct = None if rates is None else float(rates.gpu)
    memory_busy = getattr(rates, "memory", None)  # % of time device memory was read/written
    device.memory_bandwidth_util_pct = None if memory_busy is None else float(memory_busy)
    temp = _try(nvml.nvmlDeviceGetTemperature, handle, getattr(nvml, "NVML_TEMPERATURE_GPU", 0))
    device.temperature_c = None if temp is None else float(temp)
    power_mw = _try(nvml.nvmlDeviceGetPowerUsage, handle)
    device.power_w = None if power_mw is None else power_mw / 1000
    cc = _try(nvml.nvmlDeviceGetCudaComputeCapability, handle)
    if cc is not None:
        device.attributes["compute_cap"] = f"{cc[0]}.{cc[1]}"
        device.supported_dtypes = dtypes_for_compute_cap(device.attributes["compute_cap"])
    return device


def _nvml_distance(nvml: Any, a: Any, b: Any, same: bool) -> int | None:
    if same:
        return 0
    nvlink = getattr(nvml, "NVML_P2P_CAPS_INDEX_NVLINK", None)
    if nvlink is not None:
        status = _try(nvml.nvmlDeviceGetP2PStatus, a, b, nvlink)
        if status is not None and status == getattr(nvml, "NVML_P2P_STATUS_OK", 0):
            return FAST_LINK_DISTANCE
    level = _try(nvml.nvmlDeviceGetTopologyCommonAncestor, a, b)
    return None if level is None else _NVML_LEVELS.get(int(level))


def _try(fn: Any, *args: Any) -> Any:
    """``fn(*args)``, or None when NVML says the query is not supported (or fails)."""
    try:
        return fn(*args)
    except Exception:  # noqa: BLE001 - NVMLError and its many subclasses
        return None


def _text(value: Any) -> str | None:
    if value is None:
        return None
    return value.decode() if isinstance(value, bytes) else str(value)
