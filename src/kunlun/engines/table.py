"""The one table from a plan to external engines' flags and environment, per vendor family.

Every fact about how vLLM, SGLang and llama.cpp spell a plan's settings is data here; the
adapters (:mod:`kunlun.engines.builtin`) only read it. A row is one engine on one Kunlun
device type (a device plugin's ``device_type``): the python module or binary that must be
installed for it (the vendor's build or plugin), the device and attention backend flags, the
extra environment of the vendor's stack, and the dtypes that vendor build computes in. The
device's visibility variable (``CUDA_VISIBLE_DEVICES``, ``ASCEND_RT_VISIBLE_DEVICES``,
``MLU_VISIBLE_DEVICES``, ``HIP_VISIBLE_DEVICES``) is the plan's own ``env``, from the device
plugin, so it is not repeated here.

Dtype names have one owner, :data:`kunlun.planner.plan.ENGINE_DTYPES`; :data:`DTYPE_FLAGS`
holds each engine's spelling of each of them. Quantization schemes are Kunlun's
(:data:`kunlun.engine.quant.SCHEMES`): the embedded engine applies them when it loads
unquantized weights, which the external engines do not do for these schemes, so only
``none`` maps to a flag value; a plan with another scheme is refused by name.

Sources, read for the flag names (see also tests/engines/test_engine_commands.py): vLLM's
engine arguments and the vllm-ascend user guide, SGLang's server arguments and its Ascend NPU
feature table, llama.cpp's ``tools/server/README.md``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from kunlun.planner.plan import ENGINE_DTYPES


@dataclass(frozen=True, slots=True)
class VendorRow:
    """One engine on one device type."""

    requires: tuple[str, ...]
    """Python modules (or, for llama.cpp, binaries) that must be installed for this row."""
    device_flag: str | None = None
    """SGLang's ``--device`` value (None: the engine's default)."""
    attention_backend: str | None = None
    """SGLang's ``--attention-backend`` (None: the engine chooses)."""
    env: Mapping[str, str] = field(default_factory=dict)
    """Environment of the vendor's stack, on top of the plan's visibility variable."""
    dtypes: tuple[str, ...] = ENGINE_DTYPES
    """Kunlun dtypes this build computes in."""
    offload_all_layers: bool = False
    """llama.cpp: put every layer on the device (``--n-gpu-layers``); False on a CPU."""
    note: str | None = None
    needs_torch_extension: bool = False
    """Also needs the device plugin's torch extension module (its ``torch_module``, named
    only there) to be installed."""


#: Each engine's spelling of Kunlun's dtypes (every key is in ENGINE_DTYPES). llama.cpp
#: computes in the GGUF file's own types; the plan's dtype is its KV cache type.
DTYPE_FLAGS: Mapping[str, Mapping[str, str]] = MappingProxyType(
    {
        "vllm": {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"},
        "sglang": {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"},
        "llama.cpp": {"bf16": "bf16", "fp16": "f16", "fp32": "f32"},
    }
)

#: Kunlun quantization scheme -> the engine's ``--quantization`` value (None: no flag).
QUANTIZATION_FLAGS: Mapping[str, Mapping[str, str | None]] = MappingProxyType(
    {
        "vllm": {"none": None},
        "sglang": {"none": None},
    }
)

#: Why an engine has no value for a scheme (the refusal's reason).
QUANTIZATION_GAP = (
    "Kunlun's {scheme} is applied by the embedded engine when it loads unquantized weights; "
    "{engine}'s --quantization names checkpoint formats of its own, none of which is this"
)

#: Engine -> Kunlun device type -> row.
VENDORS: Mapping[str, Mapping[str, VendorRow]] = MappingProxyType(
    {
        "vllm": {
            "nvidia": VendorRow(requires=("vllm",)),
            # ROCm and Hygon DTK builds of vLLM: same module, HIP visibility from the plan
            "amd": VendorRow(requires=("vllm",)),
            "hygon": VendorRow(requires=("vllm",), note="vLLM built against Hygon DTK"),
            # the vllm-ascend platform plugin; its guide asks for spawned workers on NPUs
            "ascend": VendorRow(
                requires=("vllm", "vllm_ascend"),
                env={"VLLM_WORKER_MULTIPROC_METHOD": "spawn"},
                dtypes=("bf16", "fp16"),
            ),
            # Cambricon's vllm-mlu
            "cambricon": VendorRow(requires=("vllm", "vllm_mlu"), dtypes=("bf16", "fp16")),
        },
        "sglang": {
            "nvidia": VendorRow(requires=("sglang",), device_flag="cuda"),
            "amd": VendorRow(requires=("sglang",), device_flag="cuda", attention_backend="triton"),
            "hygon": VendorRow(
                requires=("sglang",),
                device_flag="cuda",
                attention_backend="triton",
                note="SGLang built against Hygon DTK",
            ),
            # SGLang's Ascend support: float16 and bfloat16 only
            "ascend": VendorRow(
                requires=("sglang",),
                needs_torch_extension=True,
                device_flag="npu",
                attention_backend="ascend",
                dtypes=("bf16", "fp16"),
            ),
            "cambricon": VendorRow(
                requires=("sglang",),
                needs_torch_extension=True,
                device_flag="mlu",
                dtypes=("bf16", "fp16"),
                note="Cambricon's SGLang build; upstream --device has no mlu",
            ),
        },
        "llama.cpp": {
            "cpu": VendorRow(requires=("llama-server",)),
            "nvidia": VendorRow(requires=("llama-server",), offload_all_layers=True),
            "amd": VendorRow(requires=("llama-server",), offload_all_layers=True),
        },
    }
)

#: llama.cpp's ``--n-gpu-layers`` for "every layer" (more than any model has).
ALL_LAYERS = 999


def row(engine: str, device_type: str) -> VendorRow | None:
    """The table's row for ``engine`` on ``device_type``, or None."""
    return VENDORS.get(engine, {}).get(device_type)
