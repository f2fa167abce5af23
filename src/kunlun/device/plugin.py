"""The device plugin contract and the facts a plugin reports.

A device plugin discovers the devices of one vendor family. It is found through the Python
entry-point group ``kunlun.device_plugins`` (so a vendor can ship one as its own package) and
knows, as class attributes, everything the rest of Kunlun must not hard-code about the vendor:
its tools, its visibility variable, its torch device type and extension module, the names of
its memory split in ``device-plugin-config.yaml`` and its custom attributes.

Contract of :meth:`DevicePlugin.discover`:

- it calls vendor tools only through the given :class:`~kunlun.device.tools.ToolRunner`;
- it returns the devices it saw; a device the tool reports oddly is still returned, with the
  problem in :attr:`ProbedDevice.problems` (it becomes Degraded) or an unhealthy
  :attr:`ProbedDevice.health`;
- when the vendor tool is absent it returns an empty :class:`Discovery` with a note;
- it may raise :class:`~kunlun.errors.ToolError` for a failure that loses every device; any
  other exception is a plugin bug, which the registry reports without stopping other plugins.
"""

from __future__ import annotations

import importlib
import importlib.util
from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from types import MappingProxyType
from typing import Any, ClassVar

from kunlun.device.tools import ToolRunner


class Health(StrEnum):
    """Health as the vendor tool reports it, reduced to what scheduling needs."""

    OK = "ok"
    WARNING = "warning"  # usable, but flagged: the device becomes Degraded
    UNHEALTHY = "unhealthy"  # not usable: the device becomes Unhealthy
    UNKNOWN = "unknown"  # the tool says nothing about health: treated as OK


@dataclass
class ProbedDevice:
    """What a plugin learned about one device from its tools. ``None`` means unknown."""

    device_type: str
    index: int
    name: str
    bus_id: str | None = None
    uuid: str | None = None
    memory_total_mb: int | None = None
    memory_used_mb: int | None = None
    utilization_pct: float | None = None
    memory_bandwidth_util_pct: float | None = None  # % of time device memory was busy
    temperature_c: float | None = None
    power_w: float | None = None
    health: Health = Health.UNKNOWN
    health_detail: str | None = None  # the raw word of the vendor tool, e.g. "Alarm"
    supported_dtypes: list[str] | None = None  # what the hardware can do, when known
    p2p_capable: bool | None = None  # from the vendor's topology query
    topology: list[int] | None = None  # distance row (0 self, 5 fast link, 10..50 PCIe/NUMA)
    attributes: dict[str, str] = field(default_factory=dict)  # driver version, chip model...
    problems: list[str] = field(default_factory=list)  # output that did not parse cleanly

    @property
    def id(self) -> str:
        return f"{self.device_type}:{self.index}"


@dataclass
class Discovery:
    """The result of one plugin's discovery: its devices and notes for the operator."""

    devices: list[ProbedDevice] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    tool_found: bool = True


class DevicePlugin(ABC):
    """Discovers the devices of one vendor family. Subclasses set the class attributes."""

    #: The ``device_type`` of its devices, as written in ``device-plugin-config.yaml``.
    device_type: ClassVar[str]
    vendor: ClassVar[str]
    #: Vendor tools, in order of preference (the first one present is used).
    tools: ClassVar[tuple[str, ...]] = ()
    #: Environment variable that restricts which devices a process sees.
    visibility_env: ClassVar[str | None] = None
    #: Environment variables of the vendor's runtime (its toolkit's home and library path)
    #: that a worker on this family's devices gets from the daemon's environment, when set.
    #: A sandboxed worker sees no other vendor's variables (:mod:`kunlun.sandbox`).
    runtime_env: ClassVar[tuple[str, ...]] = ()
    #: torch device type (``torch.device(torch_device_type, i)``) and the extension module
    #: that registers it (``None`` when torch has it built in).
    torch_device_type: ClassVar[str] = "cpu"
    torch_module: ClassVar[str | None] = None
    #: Fused kernels the vendor's libraries offer per operator (attention, rmsnorm, rotary,
    #: matmul) that the embedded engine does not call: a plan reports the op as a fallback
    #: on this family's devices, naming what it lacks (:mod:`kunlun.planner.operators`).
    vendor_kernels: ClassVar[Mapping[str, str]] = MappingProxyType({})
    #: The torch API that captures a decode step's kernel launches as one replayable graph on
    #: this family's devices, and the declaration's ``custom_attributes`` switch that turns
    #: it off (``False``); ``None``: the engine launches each kernel (:mod:`kunlun.engine.
    #: graphs`; the engine captures through ``torch.cuda.CUDAGraph`` only).
    graph_capture: ClassVar[tuple[str, str] | None] = None
    #: ``torch.distributed`` backend of a tensor-parallel group on this family's devices, as
    #: the vendor's torch build registers it (``None``: the family runs one device per
    #: replica).
    distributed_backend: ClassVar[str | None] = None
    #: Declaration field names of the memory split: (device memory, host-mapped memory).
    memory_fields: ClassVar[tuple[str, str] | None] = None
    #: Known ``custom_attributes`` and their types; others are kept with a warning.
    custom_attributes: ClassVar[dict[str, type]] = {}
    #: How the vendor states compute in its data sheets (the dtype of its "TFLOPS" figure).
    compute_unit_dtype: ClassVar[str] = "fp16"
    #: PCI vendor ids, for ``kunlun-cli doctor`` (an accelerator present with no driver).
    pci_vendor_ids: ClassVar[tuple[str, ...]] = ()
    #: Device nodes whose presence shows a loaded driver, e.g. ``/dev/davinci*``.
    device_nodes: ClassVar[tuple[str, ...]] = ()

    @abstractmethod
    def discover(self, tools: ToolRunner) -> Discovery:
        """Discover this family's devices through ``tools`` (see the module docstring)."""

    def torch_extension_available(self) -> bool:
        """Whether the vendor's torch extension module can be imported here."""
        if self.torch_module is None:
            return False
        try:
            return importlib.util.find_spec(self.torch_module) is not None
        except (ImportError, ValueError):
            return False

    def torch_devices(self) -> list[ProbedDevice]:
        """Second source: devices as the vendor's torch extension sees them.

        Empty when the extension is absent. Only device count, name and total memory.
        """
        if not self.torch_extension_available():
            return []
        import torch  # noqa: PLC0415 - only where an extension exists

        assert self.torch_module is not None
        importlib.import_module(self.torch_module)
        backend: Any = getattr(torch, self.torch_device_type, None)
        if backend is None or not backend.is_available():
            return []
        found = []
        for i in range(backend.device_count()):
            props = backend.get_device_properties(i)
            found.append(
                ProbedDevice(
                    device_type=self.device_type,
                    index=i,
                    name=str(getattr(props, "name", self.device_type)),
                    memory_total_mb=int(getattr(props, "total_memory", 0)) // (1024 * 1024) or None,
                )
            )
        return found
