"""The operator report of a plan: which implementation each operator (attention, rmsnorm,
rotary, matmul) gets on a device type, as the embedded engine will run it.

What runs is the engine's kernel registry (:mod:`kunlun.engine.kernels`), the one the
engine dispatches with; what the device could run besides is its plugin's
(:attr:`~kunlun.device.plugin.DevicePlugin.vendor_kernels`: fused kernels of the vendor's
libraries the engine does not call). An op is a *fallback* when the plugin offers such a
kernel for it, or when no plugin registers the device type with torch here: the plan lists
it under ``fallback_ops`` with the reason, so that what a chip lacks in Kunlun is visible.
Where Kunlun's compiled library has its own kernel for an op that torch also has (int4
weights on the CPU), the choice between them is the one measured on this CPU for the
plan's dtype (:func:`kunlun.engine.native.recorded_choice`), and the report says the figures.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from kunlun.device.dtypes import TORCH_NAMES
from kunlun.device.registry import plugin_for_torch_device
from kunlun.engine.kernels import KERNELS, OPERATORS, candidates
from kunlun.engine.native import recorded_choice

__all__ = ["OPERATORS", "OperatorChoice", "choose_operators"]


@dataclass(frozen=True)
class OperatorChoice:
    implementation: str
    fallback: bool
    why: str

    def to_dict(self) -> dict[str, object]:
        return {"implementation": self.implementation, "fallback": self.fallback, "why": self.why}


@lru_cache(maxsize=64)
def choose_operators(
    torch_device_type: str, quantization: str, dtype: str = "fp32"
) -> dict[str, OperatorChoice]:
    """The implementation of every operator on ``torch_device_type`` for ``quantization``
    and activations of ``dtype`` (fp32, bf16, fp16) (decided once per process; callers must
    not modify the result)."""
    plugin = plugin_for_torch_device(torch_device_type)
    offered = {} if plugin is None else dict(plugin.vendor_kernels)
    record = recorded_choice()
    activations = TORCH_NAMES.get(dtype, dtype)
    native = () if record is None else record.ops(activations)
    out: dict[str, OperatorChoice] = {}
    for op in OPERATORS:
        kernel = candidates(op, torch_device_type, quantization, None, native)[0]
        name = kernel.name if kernel.condition is None else f"{kernel.name} ({kernel.condition})"
        if plugin is None:
            why = f"no device plugin registers {torch_device_type} with torch: generic torch"
            out[op] = OperatorChoice(name, True, why)
        elif op in offered:
            why = f"the engine runs torch's op; {offered[op]} is not wired into it"
            out[op] = OperatorChoice(name, True, why)
        else:
            where = plugin.torch_module or "torch"
            why = (
                "Kunlun's compiled library, loaded into torch"
                if kernel.native_op
                else f"the engine's kernel, through {where}"
            )
            if any(k.native_op and k.op == op and k.serves(torch_device_type, quantization)
                   for k in KERNELS):  # fmt: skip
                why += "; " + (
                    "Kunlun's own kernel is not measured on this CPU (make setup builds and "
                    "measures the compiled library)"
                    if record is None
                    else record.describe(activations)
                )
            out[op] = OperatorChoice(name, False, why)
    return out
