"""The operator registry: which implementation each operator gets on each device type.

The registry is data. For every torch device type it lists, per operator (attention,
rmsnorm, rotary, matmul), the kernels to try in order; a kernel needs a Python module (the
device type's torch extension, :data:`EXTENSION`, whose name the device plugin owns, or a
vendor kernel library) and, for quantized matmuls, a weight quantization. The
first kernel whose module imports here wins; when none does, or the device type has no entry,
the operator falls back to the generic PyTorch implementation and the plan lists it under
``fallback_ops``. Kernels marked ``native`` are PyTorch's own path on that device (the CPU),
so using them is not a fallback.

The embedded engine calls the generic PyTorch operators on every device today; the plan
records the choice so that what a device could use, and what it lacks, is visible.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from functools import lru_cache

from kunlun.device.registry import torch_extension

OPERATORS: tuple[str, ...] = ("attention", "rmsnorm", "rotary", "matmul")

#: The generic PyTorch implementation of each operator (runs wherever torch runs).
GENERIC: dict[str, str] = {
    "attention": "torch.nn.functional.scaled_dot_product_attention",
    "rmsnorm": "torch.nn.functional.rms_norm",
    "rotary": "torch elementwise rotate-half",
    "matmul": "torch.nn.functional.linear",
}


@dataclass(frozen=True)
class Kernel:
    name: str
    module: str | None = None
    """Module that must import for the kernel to be used; None: part of torch itself;
    :data:`EXTENSION`: the device type's torch extension, as its plugin names it."""
    quantization: str | None = None
    """Only for weights quantized this way (w8a8, w4a16); None: unquantized weights."""
    native: bool = False
    """PyTorch's own implementation on this device type (not a fallback)."""


EXTENSION = "<torch extension>"
"""A kernel's :attr:`Kernel.module` when it comes with the device type's torch extension
(``torch_npu`` for npu, ``torch_mlu`` for mlu...): the plugin says which module that is."""
_NPU, _MLU_OPS = EXTENSION, "torch_mlu_ops"

REGISTRY: dict[str, dict[str, tuple[Kernel, ...]]] = {
    "npu": {
        "attention": (Kernel("npu_fusion_attention", _NPU),),
        "rmsnorm": (Kernel("npu_rms_norm", _NPU),),
        "rotary": (Kernel("npu_rotary_mul", _NPU),),
        "matmul": (
            Kernel("npu_quant_matmul", _NPU, "w8a8"),
            Kernel("npu_weight_quant_batchmatmul", _NPU, "w4a16"),
            Kernel("aclnn matmul", _NPU),
        ),
    },
    "mlu": {
        "attention": (Kernel("flash_attention (torch_mlu_ops)", _MLU_OPS),),
        "rmsnorm": (Kernel("fused_rms_norm (torch_mlu_ops)", _MLU_OPS),),
        "rotary": (Kernel("apply_rotary (torch_mlu_ops)", _MLU_OPS),),
        "matmul": (
            Kernel("smooth_quant_matmul (torch_mlu_ops)", _MLU_OPS, "w8a8"),
            Kernel("weight_only_quant_matmul (torch_mlu_ops)", _MLU_OPS, "w4a16"),
            Kernel("cnnl matmul", EXTENSION),
        ),
    },
    "cuda": {
        "attention": (Kernel("flash_attn_varlen_func (flash_attn)", "flash_attn"),),
        "matmul": (
            Kernel("torch._int_mm (int8 GEMM, above 16 tokens)", None, "w8a8", native=True),
            Kernel("cuBLAS / hipBLAS through torch", None, native=True),
        ),
    },
    "cpu": {
        "attention": (Kernel("torch sdpa (native CPU kernel)", None, native=True),),
        "rmsnorm": (Kernel("torch rms_norm (native)", None, native=True),),
        "rotary": (Kernel("torch elementwise rotate-half (native)", None, native=True),),
        "matmul": (
            Kernel("torch._weight_int8pack_mm (int8 x int8 values)", None, "w8a8", native=True),
            Kernel("torch._weight_int8pack_mm (bf16 x int8)", None, "w8a16", native=True),
            Kernel("torch._weight_int4pack_mm_for_cpu", None, "w4a16", native=True),
            Kernel("oneDNN linear through torch", None, native=True),
        ),
    },
}


@dataclass(frozen=True)
class OperatorChoice:
    implementation: str
    fallback: bool
    why: str

    def to_dict(self) -> dict[str, object]:
        return {"implementation": self.implementation, "fallback": self.fallback, "why": self.why}


@lru_cache(maxsize=64)
def importable(module: str) -> bool:
    """Whether ``module`` can be imported here (checked once per process)."""
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


@lru_cache(maxsize=64)
def choose_operators(torch_device_type: str, quantization: str) -> dict[str, OperatorChoice]:
    """The implementation of every operator on ``torch_device_type`` for ``quantization``
    (decided once per process; callers must not modify the result)."""
    entries = REGISTRY.get(torch_device_type, {})
    extension = torch_extension(torch_device_type)
    out: dict[str, OperatorChoice] = {}
    for op in OPERATORS:
        wanted = quantization if op == "matmul" and quantization != "none" else None
        kernels = [_with_extension(k, extension) for k in entries.get(op, ())]
        candidates = [k for k in kernels if k is not None and k.quantization == wanted]
        generic = GENERIC[op] if wanted is None else f"dequantize, then {GENERIC[op]}"
        missing = [k for k in candidates if k.module is not None and not importable(k.module)]
        usable = [k for k in candidates if k not in missing]
        if usable:
            kernel = usable[0]
            why = "native PyTorch path" if kernel.native else f"{kernel.module or 'torch'} imports"
            out[op] = OperatorChoice(kernel.name, False, why)
        elif missing:
            names = sorted({k.module for k in missing if k.module})
            out[op] = OperatorChoice(generic, True, f"{', '.join(names)} not importable")
        else:
            what = op if wanted is None else f"{wanted} {op}"
            out[op] = OperatorChoice(
                generic, True, f"no {torch_device_type} kernel registered for {what}"
            )
    return out


def _with_extension(kernel: Kernel, extension: str | None) -> Kernel | None:
    """``kernel`` with :data:`EXTENSION` replaced by the device type's extension module, and
    that module named after the kernel (``npu_fusion_attention (torch_npu)``); None when it
    needs an extension and no plugin names one for the device type."""
    if kernel.module != EXTENSION:
        return kernel
    if extension is None:
        return None
    return Kernel(f"{kernel.name} ({extension})", extension, kernel.quantization, kernel.native)
