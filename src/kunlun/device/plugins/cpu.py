"""The host CPU as a device: real figures from psutil and /proc, or replayed ``lscpu``.

The whole host is one device, ``cpu:0``. Memory is the host's RAM; utilization is the CPU
load; NUMA nodes and the ISA flags come from ``/proc/cpuinfo`` and ``/sys`` (live) or from
``lscpu`` and ``free -m`` output (replay). ISA flags map to dtypes: fp32 and bf16 always
(PyTorch computes bf16 on any x86-64 or Arm CPU; natively with avx512_bf16, amx_bf16 or Arm's
bf16), fp16 with avx512_fp16 / amx_fp16 / Arm fphp, int8 always (the engine's int8 weight
kernels run on any CPU; natively, ``int8_native: yes``, with VNNI / AMX-INT8 / Arm i8mm).
"""

from __future__ import annotations

import os
import platform
import re
from pathlib import Path

import psutil

from kunlun.device.plugin import DevicePlugin, Discovery, Health, ProbedDevice
from kunlun.device.tools import ToolRunner
from kunlun.errors import ToolError

_NATIVE_BF16 = {"avx512_bf16", "amx_bf16", "bf16"}
_FP16 = {"avx512_fp16", "amx_fp16", "fphp", "asimdhp"}
_INT8 = {"avx512_vnni", "avx_vnni", "amx_int8", "i8mm", "asimddp"}


def dtypes_from_flags(flags: set[str]) -> list[str]:
    """Supported dtypes for a CPU with these ISA flags (see the module docstring)."""
    dtypes = ["fp32", "bf16"]
    if flags & _FP16:
        dtypes.append("fp16")
    return [*dtypes, "int8"]


class CpuPlugin(DevicePlugin):
    device_type = "cpu"
    vendor = "host"
    tools = ("lscpu",)
    visibility_env = None
    torch_device_type = "cpu"
    distributed_backend = "gloo"
    torch_module = None
    compute_unit_dtype = "fp32"
    custom_attributes = {"num_threads": int, "numa_node": int}

    def discover(self, tools: ToolRunner) -> Discovery:
        if tools.replaying:
            return self._replayed(tools)
        flags = _proc_flags()
        vm = psutil.virtual_memory()
        device = ProbedDevice(
            device_type="cpu",
            index=0,
            name=_model_name() or platform.processor() or "cpu",
            memory_total_mb=vm.total // (1024 * 1024),
            memory_used_mb=(vm.total - vm.available) // (1024 * 1024),
            utilization_pct=psutil.cpu_percent(interval=0.1),
            health=Health.OK,
            supported_dtypes=dtypes_from_flags(flags),
            topology=[0],
        )
        device.attributes = {
            "arch": platform.machine(),
            "cores": str(psutil.cpu_count(logical=False) or os.cpu_count() or 1),
            "threads": str(os.cpu_count() or 1),
            "numa_nodes": str(_numa_nodes()),
            "bf16_native": "yes" if flags & _NATIVE_BF16 else "no",
            "int8_native": "yes" if flags & _INT8 else "no",
        }
        return Discovery([device])

    def _replayed(self, tools: ToolRunner) -> Discovery:
        if not tools.available("lscpu"):
            return Discovery(notes=["no lscpu recording in the replay directory"], tool_found=False)
        fields = _parse_lscpu(tools.run(["lscpu"]))
        flags = set(fields.get("Flags", "").split())
        device = ProbedDevice(
            device_type="cpu",
            index=0,
            name=fields.get("Model name", "cpu"),
            health=Health.OK,
            supported_dtypes=dtypes_from_flags(flags),
            topology=[0],
        )
        try:
            total, used = _parse_free(tools.run(["free", "-m"]))
            device.memory_total_mb, device.memory_used_mb = total, used
        except ToolError as exc:
            device.problems.append(f"memory unknown: {exc.message}")
        device.attributes = {
            "arch": fields.get("Architecture", "unknown"),
            "threads": fields.get("CPU(s)", "unknown"),
            "numa_nodes": fields.get("NUMA node(s)", "1"),
            "bf16_native": "yes" if flags & _NATIVE_BF16 else "no",
            "int8_native": "yes" if flags & _INT8 else "no",
        }
        return Discovery([device])


def _proc_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    match = re.search(r"^(?:flags|Features)\s*:\s*(.*)$", text, re.MULTILINE)
    return set(match.group(1).split()) if match else set()


def _model_name() -> str | None:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return None
    match = re.search(r"^model name\s*:\s*(.*)$", text, re.MULTILINE)
    return match.group(1).strip() if match else None


def _numa_nodes() -> int:
    nodes = list(Path("/sys/devices/system/node").glob("node[0-9]*"))
    return len(nodes) or 1


def _parse_lscpu(text: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if sep:
            out[key.strip()] = value.strip()
    if "CPU(s)" not in out and "Architecture" not in out:
        raise ToolError("lscpu output has neither 'Architecture' nor 'CPU(s)' lines")
    return out


def _parse_free(text: str) -> tuple[int, int]:
    for line in text.splitlines():
        parts = line.split()
        if parts and parts[0] == "Mem:" and len(parts) >= 3:
            try:
                return int(parts[1]), int(parts[2])
            except ValueError:
                break
    raise ToolError("free -m output has no parsable 'Mem:' line")
