"""The kernels the embedded engine runs: one registry the engine dispatches with and the
planner reports from, so that a plan says what will run, not what could.

Per operator (attention, rmsnorm, rotary, matmul) the kernels are listed in order of
preference; the first whose conditions hold on a device is the one the engine runs there: a
torch device type it is limited to (or excluded from), a weight quantization scheme, and a
private torch function it needs (checked with ``hasattr`` where torch is imported: by the
engine when it loads, never by the planner, which stays torch-free and reports what the
pinned torch has). Kernels are torch's own, run through its dispatcher on the device's
backend (the CPU's, CUDA's, or the one a vendor's extension registers), or Kunlun's own
operators of the compiled library (:mod:`kunlun.engine.native`), which run where that library
is loaded and, where torch has a kernel for the same job, where the library's measurement on
the CPU (``python -m kunlun.engine.native``, run by ``make setup``) found them faster; a fused
kernel a vendor library offers and the engine does not call is the device plugin's fact
(:attr:`kunlun.device.plugin.DevicePlugin.vendor_kernels`), and the planner reports the op as
a fallback there. Torch-free: the planner and the CLI import it.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass

OPERATORS: tuple[str, ...] = ("attention", "rmsnorm", "rotary", "matmul", "decode")
"""The ops a plan reports; ``decode`` is the whole decode step (:mod:`kunlun.engine.native`)."""


@dataclass(frozen=True)
class Kernel:
    op: str
    key: str
    """What the engine's code dispatches on (e.g. :class:`~kunlun.engine.models.quant_linear.
    QuantLinear`'s ``kernel``)."""
    name: str
    """What it is, as a plan reports it."""
    schemes: tuple[str, ...] = ("none",)
    """The weight quantization schemes it serves (``none``: unquantized weights)."""
    device_types: tuple[str, ...] | None = None
    """The torch device types it runs on (None: any)."""
    not_on: tuple[str, ...] = ()
    """Torch device types it does not run on."""
    torch_function: str | None = None
    """A private torch function it needs (absent from some builds)."""
    condition: str | None = None
    """A per-layer condition the engine checks when it loads (said in the report)."""
    native_op: str | None = None
    """Kunlun's own operator it runs (``torch.ops.kunlun.<native_op>``): only where the
    compiled library is loaded and its measurement on the CPU chose it."""

    def serves(self, device_type: str, scheme: str) -> bool:
        return (
            scheme in self.schemes
            and (self.device_types is None or device_type in self.device_types)
            and device_type not in self.not_on
        )


_QUANTIZED = ("w8a8", "w8a16", "w4a16")

KERNELS: tuple[Kernel, ...] = (
    Kernel(
        "attention",
        "sdpa",
        "torch.nn.functional.scaled_dot_product_attention over the paged KV cache",
        schemes=("none", *_QUANTIZED),
    ),  # fmt: skip
    Kernel("rmsnorm", "rms_norm", "torch.nn.functional.rms_norm", schemes=("none", *_QUANTIZED)),
    Kernel(
        "rotary", "rotate_half", "torch elementwise rotate-half", schemes=("none", *_QUANTIZED)
    ),  # fmt: skip
    Kernel(
        "matmul",
        "int8pack",
        "torch._weight_int8pack_mm (int8 weights, bf16 activations)",
        schemes=("w8a8", "w8a16"),
        device_types=("cpu",),
        torch_function="_weight_int8pack_mm",
    ),  # fmt: skip
    Kernel(
        "matmul",
        "int_mm",
        "torch._int_mm (int8 x int8 above 16 tokens, dequantized below)",
        schemes=("w8a8",),
        not_on=("cpu",),
        torch_function="_int_mm",
    ),  # fmt: skip
    Kernel(
        "matmul",
        "int4",
        "Kunlun's int4 kernel (tiles of 32 rows widened to float32 in registers, float32 "
        "sums; past 48 tokens (16 on AVX2), tiles dequantized for torch.mm)",
        schemes=("w4a16",),
        device_types=("cpu",),
        condition="where the compiled library is built and measured faster than torch's "
        "int4pack on this CPU, for layers whose output width is a multiple of 32",
        native_op="int4_matmul",
    ),  # fmt: skip
    Kernel(
        "matmul",
        "int4pack",
        "torch._weight_int4pack_mm_for_cpu",
        schemes=("w4a16",),
        device_types=("cpu",),
        torch_function="_weight_int4pack_mm_for_cpu",
        condition="layers whose output width is a multiple of 16",
    ),  # fmt: skip
    Kernel(
        "matmul", "dequantize", "dequantize, then torch.nn.functional.linear", schemes=_QUANTIZED
    ),  # fmt: skip
    Kernel("matmul", "linear", "torch.nn.functional.linear"),
    Kernel(
        "decode",
        "compiled",
        "Kunlun's compiled decode step (C++, no Python per layer; int8 rows, floating weights "
        "and, where measured faster, int4 tiles through its own kernels: bf16 on AMX tiles "
        "where the CPU has them)",
        schemes=("none", *_QUANTIZED),
        device_types=("cpu",),
        condition="float32 or bfloat16 on one rank, built by make setup; else the reference "
        "path, said in the worker's log",
    ),  # fmt: skip
    Kernel(
        "decode",
        "modules",
        "the model's modules, one Python call each (the reference path)",
        schemes=("none", *_QUANTIZED),
    ),  # fmt: skip
)


def candidates(
    op: str,
    device_type: str,
    scheme: str,
    has_function: Callable[[str], bool] | None = None,
    native_ops: Collection[str] = (),
) -> list[Kernel]:
    """The kernels of ``op`` for ``scheme`` on torch device type ``device_type``, best
    first; ``has_function`` says whether torch has a private function (None: assume the
    pinned torch, which has them all); ``native_ops`` are Kunlun's own operators that run
    (the engine's measured choice, :func:`kunlun.engine.native.native_ops`; the planner's,
    :func:`kunlun.engine.native.recorded_choice`; none: torch's kernels only). The last one
    always runs."""
    found = [
        k
        for k in KERNELS
        if k.op == op
        and k.serves(device_type, scheme)
        and (k.torch_function is None or has_function is None or has_function(k.torch_function))
        and (k.native_op is None or k.native_op in native_ops)
    ]
    if not found:
        raise ValueError(f"no kernel for {op} with {scheme} weights on {device_type}")
    return found
