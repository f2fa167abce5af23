"""The operator report of a plan: which implementation each operator (attention, rmsnorm,
rotary, matmul) gets on a device type, as the embedded engine will run it.

What runs is the engine's kernel registry (:mod:`kunlun.engine.kernels`), the one the
engine dispatches with; what the device could run besides is its plugin's
(:attr:`~kunlun.device.plugin.DevicePlugin.vendor_kernels`: fused kernels of the vendor's
libraries the engine does not call). An op is a *fallback* when the plugin offers such a
kernel for it, or when no plugin registers the device type with torch here: the plan lists
it under ``fallback_ops`` with the reason, so that what a chip lacks in Kunlun is visible.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from kunlun.device.registry import plugin_for_torch_device
from kunlun.engine.kernels import OPERATORS, candidates

__all__ = ["OPERATORS", "OperatorChoice", "choose_operators"]


@dataclass(frozen=True)
class OperatorChoice:
    implementation: str
    fallback: bool
    why: str

    def to_dict(self) -> dict[str, object]:
        return {"implementation": self.implementation, "fallback": self.fallback, "why": self.why}


@lru_cache(maxsize=64)
def choose_operators(torch_device_type: str, quantization: str) -> dict[str, OperatorChoice]:
    """The implementation of every operator on ``torch_device_type`` for ``quantization``
    (decided once per process; callers must not modify the result)."""
    plugin = plugin_for_torch_device(torch_device_type)
    offered = {} if plugin is None else dict(plugin.vendor_kernels)
    out: dict[str, OperatorChoice] = {}
    for op in OPERATORS:
        kernel = candidates(op, torch_device_type, quantization)[0]
        name = kernel.name if kernel.condition is None else f"{kernel.name} ({kernel.condition})"
        if plugin is None:
            why = f"no device plugin registers {torch_device_type} with torch: generic torch"
            out[op] = OperatorChoice(name, True, why)
        elif op in offered:
            why = f"the engine runs torch's op; {offered[op]} is not wired into it"
            out[op] = OperatorChoice(name, True, why)
        else:
            where = plugin.torch_module or "torch"
            out[op] = OperatorChoice(name, False, f"the engine's kernel, through {where}")
    return out
