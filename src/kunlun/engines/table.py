"""The shape of an external engine's facts per vendor family; the rows themselves are the
adapters' own (``vendors``, ``dtype_flags``, ``quantization_flags`` of each class in
:mod:`kunlun.engines.builtin`), so an engine's facts live on its adapter.

A row is one engine on one Kunlun device type (a device plugin's ``device_type``): the python
module or binary that must be installed for it (the vendor's build or plugin), the device and
attention backend flags, the extra environment of the vendor's stack, and the dtypes that
vendor build computes in. The device's visibility variable (``CUDA_VISIBLE_DEVICES``,
``ASCEND_RT_VISIBLE_DEVICES``, ``MLU_VISIBLE_DEVICES``, ``HIP_VISIBLE_DEVICES``) is the plan's
own ``env``, from the device plugin, so it is not repeated in a row.

Dtype names have one owner, :data:`kunlun.planner.plan.ENGINE_DTYPES`; each adapter's
``dtype_flags`` spells each of them. Quantization schemes are Kunlun's
(:data:`kunlun.engine.schemes.SCHEMES`): the embedded engine applies them when it loads
unquantized weights, which the external engines do not do for these schemes, so only
``none`` maps to a flag value; a plan with another scheme is refused by name
(:data:`QUANTIZATION_GAP`).

Sources, read for the flag names (see also tests/engines/test_engine_commands.py): vLLM's
engine arguments and the vllm-ascend user guide, SGLang's server arguments and its Ascend NPU
feature table, llama.cpp's ``tools/server/README.md``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

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


#: Why an engine has no value for a scheme (the refusal's reason).
QUANTIZATION_GAP = (
    "Kunlun's {scheme} is applied by the embedded engine when it loads unquantized weights; "
    "{engine}'s --quantization names checkpoint formats of its own, none of which is this"
)

#: llama.cpp's ``--n-gpu-layers`` for "every layer" (more than any model has).
ALL_LAYERS = 999
