"""Shared helpers for planner and placement tests: recorded nodes, shipped model configs and
modified copies of a node's declaration."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from kunlun.device.inventory import Inventory, build_inventory
from kunlun.planner.model_info import ModelInfo, inspect_model

ROOT = Path(__file__).resolve().parents[2]
NODES = ROOT / "examples" / "nodes"
MODELS = ROOT / "examples" / "models"


def node(name: str, config: Path | None = None) -> Inventory:
    """The replayed node ``examples/nodes/<name>`` with its own (or the given) declaration."""
    return build_inventory(
        config=config or NODES / name / "device-plugin-config.yaml", replay=NODES / name
    )


def model(name: str) -> ModelInfo:
    return inspect_model(MODELS / name)


EditConfig = Callable[[str, Callable[[dict[str, Any]], None]], Path]


@pytest.fixture
def edited_config(tmp_path: Path) -> EditConfig:
    """``edited_config(node, edit)``: a copy of the node's declaration in ``tmp_path`` with
    ``edit(device)`` applied to every declared device (a dict of its fields)."""

    def make(name: str, edit: Callable[[dict[str, Any]], None]) -> Path:
        data = yaml.safe_load((NODES / name / "device-plugin-config.yaml").read_text())
        for device in data["devices"]:
            edit(device)
        path = tmp_path / f"{name}-device-plugin-config.yaml"
        path.write_text(yaml.safe_dump(data))
        return path

    return make
