"""AMD Instinct and Radeon GPUs through ROCm's ``rocm-smi`` and ``rocminfo``.

Discovery runs ``rocm-smi --showid --showmeminfo vram ... --json`` (memory, use, power,
temperature, product name, unique id), ``rocminfo`` (marketing name, gfx target, bus id) and
``rocm-smi --showtopo --json`` (XGMI / PCIe links); parsing is shared with the Hygon plugin in
:mod:`kunlun.device.plugins.rocm`. Cards that are Hygon DCUs (DTK's rocm-smi lists them too)
are left to the ``hygon`` plugin, so a Hygon node lists no ``amd`` devices.

Visibility: ``HIP_VISIBLE_DEVICES`` is what Kunlun sets; the ROCm runtime also honours
``ROCR_VISIBLE_DEVICES`` (applied first, at the HSA level) and ``CUDA_VISIBLE_DEVICES``.
ROCm builds of PyTorch expose the GPUs as the ``cuda`` device type; there is no extension
module to import.
"""

from __future__ import annotations

from kunlun.device.plugin import DevicePlugin, Discovery
from kunlun.device.plugins.rocm import (
    ROCM_SMI_ARGV,
    RocmFamily,
    discover_cards,
    parse_smi_json,
)
from kunlun.device.tools import ToolRunner

TOPO_ARGV = ["rocm-smi", "--showtopo", "--json"]

# What the matrix / vector units compute natively, by gfx target (AMD ISA and ROCm
# "precision support" documentation, as best known; fp8 on CDNA3 is the FNUZ variant):
#   CDNA3/4 (gfx94x, gfx950): fp32, bf16, fp16, fp8, int8;  CDNA1/2 (gfx908, gfx90a): fp32,
#   bf16, fp16, int8;  Vega20 (gfx906): fp32, fp16, int8 (dot4);  RDNA4 (gfx12xx): WMMA fp16,
#   bf16, fp8, int8;  RDNA3 (gfx11xx): WMMA fp16, bf16, int8;  RDNA2 (gfx103x): fp16, int8 dot4.
_BY_PREFIX: tuple[tuple[str, list[str]], ...] = (
    ("gfx94", ["fp32", "bf16", "fp16", "fp8_e4m3", "fp8_e5m2", "int8"]),
    ("gfx95", ["fp32", "bf16", "fp16", "fp8_e4m3", "fp8_e5m2", "int8"]),
    ("gfx90a", ["fp32", "bf16", "fp16", "int8"]),
    ("gfx908", ["fp32", "bf16", "fp16", "int8"]),
    ("gfx906", ["fp32", "fp16", "int8"]),
    ("gfx12", ["fp32", "bf16", "fp16", "fp8_e4m3", "fp8_e5m2", "int8"]),
    ("gfx11", ["fp32", "bf16", "fp16", "int8"]),
    ("gfx103", ["fp32", "fp16", "int8"]),
    ("gfx10", ["fp32", "fp16"]),
)


def amd_dtypes(gfx: str | None) -> list[str] | None:
    """Supported dtypes of an AMD gfx target; ``None`` when the target is not known."""
    for prefix, dtypes in _BY_PREFIX:
        if gfx and gfx.startswith(prefix):
            return list(dtypes)
    return None


_FAMILY = RocmFamily(device_type="amd", claims_hygon=False, other_type="hygon", dtypes=amd_dtypes)


class AmdPlugin(DevicePlugin):
    """AMD GPUs (ROCm). Visibility: ``HIP_VISIBLE_DEVICES`` (``ROCR_VISIBLE_DEVICES`` too)."""

    device_type = "amd"
    vendor = "AMD"
    tools = ("rocm-smi", "rocminfo")
    visibility_env = "HIP_VISIBLE_DEVICES"
    runtime_env = ("ROCM_PATH", "HIP_PATH", "LD_LIBRARY_PATH")
    torch_device_type = "cuda"  # ROCm builds of PyTorch use the cuda device type
    distributed_backend = "nccl"  # RCCL, under the nccl name
    torch_module = None
    memory_fields = None
    custom_attributes = {"hipblaslt_enabled": bool}
    compute_unit_dtype = "fp16"
    pci_vendor_ids = ("1002",)
    device_nodes = ("/dev/kfd", "/dev/dri/renderD*")

    def discover(self, tools: ToolRunner) -> Discovery:
        if not tools.available("rocm-smi"):
            return Discovery(notes=["rocm-smi not found (ROCm is not installed)"], tool_found=False)
        return discover_cards(tools, _FAMILY, ROCM_SMI_ARGV, parse_smi_json, TOPO_ARGV)
