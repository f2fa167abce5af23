"""Hygon DCUs through Hygon's ``hy-smi``, or DTK's ``rocm-smi`` when hy-smi is absent.

``hy-smi`` is preferred. Its parser follows Hygon's documented text output (DTK 24.04
"hy-smi" usage guide, hyhal ``/opt/hyhal/bin/hy-smi``): a rocm-smi style log, one
``DCU[i]  : <key>: <value>`` line per fact (``HCU[i]`` on newer parts), with the DTK keys
``DCU use (%)``, ``vram Total Memory (MiB)``, ``vram Total Used Memory (MiB)``,
``Card Series``, ``Card Vendor``, ``Unique ID``, ``Temperature (Sensor edge) (C)``,
``Average Graphics Package Power (W)``. No recorded hy-smi sample was available: the tests
use a fake ``hy-smi`` printing that documented form. When hy-smi is absent or fails, DTK's
``rocm-smi ... --json`` is parsed instead (recorded DTK 24.04.3 output in the tests).
``rocminfo`` gives the marketing name (e.g. ``K100_AI``), gfx target and bus id; topology comes
from ``--showtopo --json`` of the same tool. Parsing is shared with the AMD plugin
(:mod:`kunlun.device.plugins.rocm`); only cards whose vendor is Hygon ("Chengdu Haiguang IC
Design") or that carry DTK-only keys are claimed here, the rest are left to ``amd``.

Visibility: ``HIP_VISIBLE_DEVICES`` (``ROCR_VISIBLE_DEVICES`` is honoured as well). DTK
builds of PyTorch expose DCUs as the ``cuda`` device type.
"""

from __future__ import annotations

from kunlun.device.plugin import DevicePlugin, Discovery
from kunlun.device.plugins.rocm import (
    ROCM_SMI_ARGV,
    SMI_QUERY,
    RocmFamily,
    discover_cards,
    parse_smi_json,
    parse_smi_lines,
)
from kunlun.device.tools import ToolRunner
from kunlun.errors import ToolError

HY_SMI_ARGV = ["hy-smi", *SMI_QUERY]

# Native dtypes by gfx target, from Hygon's product pages and DTK notes as best known:
# Z100 (gfx906): fp32, fp16;  K100 (gfx926): fp32, fp16, int8;  K100_AI (gfx928) and
# BW1000 (gfx936): fp32, bf16, fp16, int8. Unknown targets give None (declare them).
_BY_TARGET: dict[str, list[str]] = {
    "gfx906": ["fp32", "fp16"],
    "gfx926": ["fp32", "fp16", "int8"],
    "gfx928": ["fp32", "bf16", "fp16", "int8"],
    "gfx936": ["fp32", "bf16", "fp16", "int8"],
}


def hygon_dtypes(gfx: str | None) -> list[str] | None:
    """Supported dtypes of a Hygon gfx target; ``None`` when the target is not known."""
    dtypes = _BY_TARGET.get(gfx or "")
    return list(dtypes) if dtypes else None


_FAMILY = RocmFamily(device_type="hygon", claims_hygon=True, other_type="amd", dtypes=hygon_dtypes)


class HygonPlugin(DevicePlugin):
    """Hygon DCUs. Visibility: ``HIP_VISIBLE_DEVICES`` (``ROCR_VISIBLE_DEVICES`` too)."""

    device_type = "hygon"
    vendor = "Hygon"
    tools = ("hy-smi", "rocm-smi", "rocminfo")
    visibility_env = "HIP_VISIBLE_DEVICES"
    runtime_env = ("ROCM_PATH", "DTK_HOME", "LD_LIBRARY_PATH")
    torch_device_type = "cuda"  # DTK builds of PyTorch use the cuda device type
    distributed_backend = "nccl"  # DTK ships RCCL under the nccl name
    torch_module = None
    memory_fields = ("vram_memory_mb", "gddr6_memory_mb")
    custom_attributes = {"hipblaslt_enabled": bool}
    compute_unit_dtype = "fp32"
    pci_vendor_ids = ("1d94",)
    device_nodes = ("/dev/kfd", "/dev/mkfd", "/dev/dri/renderD*")

    def discover(self, tools: ToolRunner) -> Discovery:
        notes: list[str] = []
        if tools.available("hy-smi"):
            try:
                found = discover_cards(
                    tools, _FAMILY, HY_SMI_ARGV, parse_smi_lines, ["hy-smi", "--showtopo", "--json"]
                )
            except ToolError as exc:
                if not tools.available("rocm-smi"):
                    raise
                notes.append(f"hy-smi failed, using rocm-smi: {exc.message}")
            else:
                return found
        if not tools.available("rocm-smi"):
            return Discovery(
                notes=["neither hy-smi nor rocm-smi found (DTK is not installed)"],
                tool_found=False,
            )
        found = discover_cards(
            tools, _FAMILY, ROCM_SMI_ARGV, parse_smi_json, ["rocm-smi", "--showtopo", "--json"]
        )
        found.notes[:0] = notes
        return found
