"""The names of the weight quantization schemes, and which of them keep int8 weights.

The one list every consumer reads (the engine's :mod:`~kunlun.engine.quant`, the workload
spec, the planner, the CLI's help): a module of no imports, so that the CLI's start-up does
not pay for the engine's quantization code to print a help line.
"""

from __future__ import annotations

SCHEMES: tuple[str, ...] = ("none", "w8a8", "w8a16", "w4a16")
"""Weight quantization schemes, ``"none"`` first."""
INT8_SCHEMES: tuple[str, ...] = ("w8a8", "w8a16")
"""The schemes whose weights are int8 (w8a8 quantizes activations too)."""


def listed(schemes: tuple[str, ...] = SCHEMES) -> str:
    """``schemes`` as a help text says them: ``none, w8a8, w8a16 or w4a16``."""
    return ", ".join(schemes[:-1]) + " or " + schemes[-1]


COMPUTE_DTYPES: dict[str, str] = {"w8a8": "int8"}
"""Schemes whose matrix products run in another dtype than the activations': the device must
support it (``supported_dtypes``), and its compute figure is the one that applies."""


def compute_dtype(scheme: str, dtype: str) -> str:
    """The dtype the matrix products of ``scheme`` run in, with activations in ``dtype``."""
    return COMPUTE_DTYPES.get(scheme, dtype)


def agrees(asked: str, stored: str) -> bool:
    """Whether asking ``asked`` of a checkpoint already quantized in ``stored`` agrees with it:
    ``"none"`` (nothing more to do) or the same scheme. A quantized checkpoint always runs in
    its own scheme; asking another is refused, by the planner
    (:mod:`kunlun.workload.placement.placer`) and by the engine loading it
    (:func:`kunlun.engine.quant.resolve_spec`) alike."""
    return asked in ("none", stored)
