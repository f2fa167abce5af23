"""Telemetry tests use the recorded vendor-tool output of the seed's mixed server."""

from __future__ import annotations

from pathlib import Path

from kunlun.device.inventory import Inventory, build_inventory

MIXED = Path(__file__).parents[2] / "examples" / "nodes" / "mixed"


def mixed_inventory() -> Inventory:
    """The mixed server (4 Ascend, 2 Cambricon, 1 NVIDIA T4) from its recordings."""
    return build_inventory(config=MIXED / "device-plugin-config.yaml", replay=MIXED)
