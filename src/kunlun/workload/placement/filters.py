"""Placement filters: which devices and options can run a demand, and why not the others.

Each filter returns what it keeps and a :class:`~kunlun.planner.plan.Rejection` with the
reason for everything it drops, so that every placement can be explained:

1. health: Unhealthy and Excluded devices are rejected with their profile's reasons;
2. explicit device: only that device's class, with only that device;
3. dtype and quantization support, and 4. memory fit at the smallest tensor-parallel size:
   :func:`kunlun.planner.plan.options`;
5. runnable here (the torch backend imports; tensor parallelism needs the plugin's
   distributed backend; weights floating or in Kunlun's own quantized format), only
   when the workload is actually starting.
"""

from __future__ import annotations

import importlib.util

from kunlun.device.profile import Status
from kunlun.device.registry import torch_extension
from kunlun.engine.quant import QUANT_METHOD
from kunlun.errors import ConfigError, Location
from kunlun.planner.capacity import DeviceCapacity
from kunlun.planner.plan import Demand, Option, Rejection, options
from kunlun.workload.pool import DevicePool


def runnable(device: DeviceCapacity) -> str | None:
    """None when the embedded engine's torch backend for ``device`` imports here, else why not.
    The backend's module is the one the device's plugin names (torch itself when none)."""
    kind = device.torch_device_type
    if kind == "cpu":
        return None
    module = torch_extension(kind) or "torch"
    if importlib.util.find_spec(module) is None:
        return f"the torch backend for {kind} ({module}) is not installed here"
    return None


def pools_for(
    pools: list[DevicePool], by_id: dict[str, DeviceCapacity], demand: Demand
) -> list[DevicePool]:
    """The classes ``demand`` may use: all, or only the explicit device's (a ConfigError
    listing the devices when it does not exist)."""
    if demand.device is None:
        return pools
    if demand.device not in by_id:
        known = ", ".join(by_id)
        raise ConfigError(f"device {demand.device!r} does not exist; devices: {known}",
                          location=Location("device"))  # fmt: skip
    return [p for p in pools if any(c.device_id == demand.device for c in p.caps)]


def explicit_index(pool: DevicePool, demand: Demand) -> int | None:
    """The position in ``pool`` of the demand's explicit device, or None when it names none."""
    if demand.device is None:
        return None
    return next(i for i, c in enumerate(pool.caps) if c.device_id == demand.device)


def judge_class(
    pool: DevicePool, demand: Demand, num_devices: int, *, starting: bool
) -> tuple[list[Option], list[Rejection]]:
    """The options of ``pool`` (with ``num_devices`` of its devices) that pass every filter,
    best first, and the rejected ones with their reasons."""
    cap, label = pool.first, pool.label
    if cap.status not in (Status.READY, Status.DEGRADED):
        why = "; ".join(cap.reasons) or "no reason given"
        return [], [Rejection(label, None, None, f"status {cap.status.value}: {why}")]
    found, rejected = options(demand, cap, num_devices, label)
    if starting and found:
        found, refused = _runnable_options(cap, demand, found, label)
        rejected += refused
    return found, rejected


def _runnable_options(
    cap: DeviceCapacity, demand: Demand, found: list[Option], label: str
) -> tuple[list[Option], list[Rejection]]:
    """Only what the embedded engine can start here: backend importable, tensor parallelism
    only where the device plugin names a distributed backend, weights floating or in Kunlun's
    own quantized format. Every scheme runs on every torch device: with packed int8/int4
    kernels on the CPU, ``torch._int_mm`` for w8a8 on CUDA-like devices, and elsewhere a
    dequantize-then-matmul fallback (:mod:`kunlun.engine.models.quant_linear`)."""
    if (why := runnable(cap)) is not None:
        return [], [Rejection(label, None, None, why)]
    checkpoint = demand.model.quantization
    if checkpoint is not None and checkpoint.method != QUANT_METHOD:
        return [], [Rejection(label, None, None, f"the embedded engine reads quantized weights "
                              f"in its own format only (quant_method {QUANT_METHOD!r}), not "
                              f"{checkpoint.method!r}; quantize the floating-point model with "
                              f"kunlun-cli model quantize")]  # fmt: skip
    if distributed_backend(cap) is not None:
        return found, []
    kept = [o for o in found if o.tp == 1]
    refused = [Rejection(label, o.dtype, o.tp, f"the {cap.device_type} device plugin names no "
                         "torch.distributed backend: one device per replica")
               for o in found if o.tp > 1]  # fmt: skip
    return kept, refused


def distributed_backend(cap: DeviceCapacity) -> str | None:
    """The torch.distributed backend of ``cap``'s device plugin (None: no tensor parallelism)."""
    from kunlun.device.registry import load_plugins

    plugin = load_plugins().plugins.get(cap.device_type)
    return None if plugin is None else plugin.distributed_backend
