"""Vendor ``custom_attributes`` of a declaration, mapped to engine options and environment.

Each attribute a device plugin knows (see each plugin's ``custom_attributes``) maps to one
documented engine option; a few also set an environment variable of the vendor's stack. The
table is data; docs/plans.md lists it. An attribute without a mapping is kept
in the plan's notes, not silently dropped.

| attribute | engine option | environment |
|---|---|---|
| ``aclnn_fusion_enabled`` (Ascend) | ``operator_fusion`` | - |
| ``magicmind_opt_level`` (Cambricon) | ``graph_opt_level`` | - |
| ``mlu_stream_priority`` (Cambricon) | ``stream_priority`` | - |
| ``hipblaslt_enabled`` (AMD, Hygon) | ``hipblaslt`` | ``TORCH_BLAS_PREFER_HIPBLASLT`` = 1 / 0 |
| ``cuda_graphs``, ``musa_graphs``, ``xpu_graph_enabled``, ``topsgraph_enabled`` | ``graph_capture`` | - |
| ``num_threads`` (CPU) | ``num_threads`` (the worker's ``--num-threads``) | - |
| ``numa_node`` (CPU) | ``numa_node`` | - |

Of these the embedded engine applies ``num_threads`` and ``cuda_graphs`` (false turns off
the decode graphs a plan captures on NVIDIA devices: :mod:`kunlun.engine.graphs`); the others
are recorded for engines that take them, and the environment variables are set for the
worker.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class AttributeOption:
    option: str
    env: str | None = None
    applied_by_embedded: bool = False


ATTRIBUTE_OPTIONS: dict[str, AttributeOption] = {
    "aclnn_fusion_enabled": AttributeOption("operator_fusion"),
    "magicmind_opt_level": AttributeOption("graph_opt_level"),
    "mlu_stream_priority": AttributeOption("stream_priority"),
    "hipblaslt_enabled": AttributeOption("hipblaslt", env="TORCH_BLAS_PREFER_HIPBLASLT"),
    "cuda_graphs": AttributeOption("graph_capture", applied_by_embedded=True),
    "musa_graphs": AttributeOption("graph_capture"),
    "xpu_graph_enabled": AttributeOption("graph_capture"),
    "topsgraph_enabled": AttributeOption("graph_capture"),
    "num_threads": AttributeOption("num_threads", applied_by_embedded=True),
    "numa_node": AttributeOption("numa_node"),
}


def engine_options(attributes: dict[str, Any]) -> tuple[dict[str, Any], dict[str, str], list[str]]:
    """``(options, environment, notes)`` for a device's declared ``custom_attributes``."""
    options: dict[str, Any] = {}
    env: dict[str, str] = {}
    notes: list[str] = []
    for name, value in sorted(attributes.items()):
        mapping = ATTRIBUTE_OPTIONS.get(name)
        if mapping is None:
            notes.append(f"custom attribute {name}={value!r} has no engine option; not used")
            continue
        options[mapping.option] = value
        if mapping.env is not None:
            env[mapping.env] = ("1" if value else "0") if isinstance(value, bool) else str(value)
        if not mapping.applied_by_embedded:
            notes.append(
                f"engine option {mapping.option}={value!r} (from {name}) is recorded; "
                "the embedded engine does not use it"
            )
    return options, env, notes
