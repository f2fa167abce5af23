"""Iluvatar CoreX GPUs (天垓 BI-V100/BI-V150, 智铠 MR-V50/MR-V100) through ``ixsmi``.

No public sample of ``ixsmi`` output is in ``tests/fixtures``. This parser follows Iluvatar's
CoreX SDK documentation of ``ixsmi`` (CoreX 3.x/4.x, "ixsmi 使用说明"): ``ixsmi`` is derived
from ``nvidia-smi`` and accepts the same ``--query-gpu=... --format=csv`` interface, printing
one CSV line per GPU, e.g. ``0, Iluvatar BI-V100, 00000000:13:00.0, GPU-..., 32768, 116, 0,
30, 45.0``. Some versions ignore ``nounits`` and append units (``32768 MiB``, ``0 %``); both
forms are read (:func:`kunlun.device.plugins.nvidia.parse_gpu_query`). ``ixsmi topo -m``
prints the ``nvidia-smi topo -m`` matrix. The tool reports no health word, so health is OK
for every GPU that answers the query (or a fault word such as ``[GPU is lost]``).

CoreX is CUDA-compatible: its PyTorch build is a ``torch`` wheel whose devices are ``cuda``
devices, selected with ``CUDA_VISIBLE_DEVICES``; no extension module is imported.
"""

from __future__ import annotations

from kunlun.device.plugin import DevicePlugin, Discovery
from kunlun.device.plugins.nvidia import parse_gpu_query, query_argv
from kunlun.device.plugins.smi_output import dtypes_for_name
from kunlun.device.plugins.smi_topology import attach_topology
from kunlun.device.tools import ToolRunner

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
)

#: Data-sheet dtypes by model (Iluvatar product pages: 天垓100 / 天垓150 train in FP32,
#: FP16, BF16 and INT8; 智铠 MR-V50 / MR-V100 inference cards run FP32, FP16 and INT8).
_DTYPES = {
    "BI-V100": ["fp32", "bf16", "fp16", "int8"],
    "BI-V150": ["fp32", "bf16", "fp16", "int8"],
    "MR-V100": ["fp32", "fp16", "int8"],
    "MR-V50": ["fp32", "fp16", "int8"],
}


def dtypes_for_model(name: str) -> list[str] | None:
    """Supported dtypes of an Iluvatar GPU from its name (None when the model is unknown)."""
    return dtypes_for_name(_DTYPES, name)


class IluvatarPlugin(DevicePlugin):
    device_type = "iluvatar"
    vendor = "Iluvatar CoreX"
    tools = ("ixsmi",)
    visibility_env = "CUDA_VISIBLE_DEVICES"
    runtime_env = ("COREX_HOME", "LD_LIBRARY_PATH")
    torch_device_type = "cuda"
    distributed_backend = "nccl"
    torch_module = None
    memory_fields = None
    custom_attributes = {"cuda_graphs": bool}
    compute_unit_dtype = "fp16"
    pci_vendor_ids = ("1e3e",)
    device_nodes = ("/dev/iluvatar[0-9]*",)

    def discover(self, tools: ToolRunner) -> Discovery:
        if not tools.available("ixsmi"):
            return Discovery(notes=["ixsmi not found"], tool_found=False)
        argv = query_argv("ixsmi", QUERY_FIELDS)
        devices = parse_gpu_query(tools.run(argv), QUERY_FIELDS, "iluvatar", " ".join(argv[:2]))
        for device in devices:
            device.supported_dtypes = dtypes_for_model(device.name)
        if not devices:
            return Discovery(notes=["ixsmi reports no GPUs"])
        notes = attach_topology(devices, tools, ["ixsmi", "topo", "-m"], "GPU")
        return Discovery(devices, notes)
