"""The one dtype vocabulary, and compute figures normalized per dtype.

Vendors quote compute in different units (the seed's table: Ascend in FP16 TFLOPS, Cambricon
in INT8 TOPS, Hygon in FP32 TFLOPS). Kunlun keeps one figure per dtype, so that profiles
compare like with like; a figure that was not declared is derived from one that was, with
the usual dense-throughput ratios, and marked ``defaulted``.
"""

from __future__ import annotations

DTYPES: tuple[str, ...] = ("fp32", "bf16", "fp16", "fp8_e4m3", "fp8_e5m2", "int8", "int4")

#: The floating dtypes a model computes in, by the names torch (and transformers' configs)
#: give them.
TORCH_NAMES: dict[str, str] = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}

#: Throughput relative to fp16 on a typical accelerator with matrix units.
_RELATIVE_TO_FP16: dict[str, float] = {
    "fp32": 0.5,
    "bf16": 1.0,
    "fp16": 1.0,
    "fp8_e4m3": 2.0,
    "fp8_e5m2": 2.0,
    "int8": 2.0,
    "int4": 4.0,
}

#: Declaration fields that state compute, and the dtype each one is measured in.
COMPUTE_FIELDS: dict[str, str] = {
    "fp32_compute_power_tflops": "fp32",
    "fp16_compute_power_tflops": "fp16",
    "bf16_compute_power_tflops": "bf16",
    "fp8_compute_power_tflops": "fp8_e4m3",
    "int8_compute_power_tflops": "int8",
    "int4_compute_power_tflops": "int4",
}


def normalize_compute(declared: dict[str, float]) -> dict[str, tuple[float, bool]]:
    """Per-dtype TFLOPS (or TOPS for integers) from what was declared.

    ``declared`` maps dtype -> figure. Returns dtype -> (figure, derived); figures for dtypes
    not declared are derived from the declared figure nearest in kind (prefer fp16, then
    bf16, int8, fp32), scaled by the usual ratios.
    """
    if not declared:
        return {}
    preference = ("fp16", "bf16", "int8", "fp32", "fp8_e4m3", "fp8_e5m2", "int4")
    base_dtype = next(d for d in preference if d in declared)
    fp16_equiv = declared[base_dtype] / _RELATIVE_TO_FP16[base_dtype]
    out: dict[str, tuple[float, bool]] = {}
    for dtype in DTYPES:
        if dtype in declared:
            out[dtype] = (float(declared[dtype]), False)
        else:
            out[dtype] = (round(fp16_equiv * _RELATIVE_TO_FP16[dtype], 3), True)
    return out
