"""The seed's mixed server (examples/nodes/mixed): 4 Ascend 910B, 2 MLU370, 1 T4, all Ready."""

from __future__ import annotations

from pathlib import Path

import pytest

from kunlun.device.inventory import Inventory, build_inventory
from kunlun.device.profile import Provenance, Status

MIXED = Path(__file__).parents[3] / "examples" / "nodes" / "mixed"


@pytest.fixture(scope="module")
def inventory() -> Inventory:
    return build_inventory(config=MIXED / "device-plugin-config.yaml", replay=MIXED)


def test_every_declared_device_is_found_and_ready(inventory: Inventory) -> None:
    ids = [p.id for p in inventory.profiles]
    assert ids == [f"ascend:{i}" for i in range(4)] + ["cambricon:0", "cambricon:1", "nvidia:0"]
    assert {p.id: p.status for p in inventory.profiles} == dict.fromkeys(ids, Status.READY)
    assert all(p.reasons == [] for p in inventory.profiles)
    assert inventory.exit_code() == 0


def test_ascend_devices(inventory: Inventory) -> None:
    npu = inventory.get("ascend:2")
    assert npu is not None
    assert npu.name == "Ascend 910B" and npu.torch_device_type == "npu"
    assert npu.fields["memory_total_mb"].value == 65536
    assert npu.fields["memory_total_mb"].provenance is Provenance.VALIDATED
    assert npu.get("sys_memory_mb") == 1024
    assert npu.get("supported_dtypes") == ["fp16", "bf16", "int8"]
    assert npu.get("p2p_enabled") is True
    assert npu.get("topology_distance") == [5, 5, 0, 5]
    assert npu.get("compute_tflops")["fp16"] == 256 and npu.get("compute_tflops")["int8"] == 512
    assert npu.get("custom_attributes") == {"aclnn_fusion_enabled": True}


def test_cambricon_devices(inventory: Inventory) -> None:
    mlu = inventory.get("cambricon:1")
    assert mlu is not None
    assert mlu.name == "MLU370-X4" and mlu.visibility_env == "MLU_VISIBLE_DEVICES"
    assert mlu.fields["memory_total_mb"].provenance is Provenance.VALIDATED
    assert mlu.get("memory_total_mb") == 24576 and mlu.get("ddr_memory_mb") == 1024
    assert mlu.supports("int8") and mlu.get("compute_tflops")["int8"] == 256
    assert mlu.fields["p2p_enabled"].provenance is Provenance.DECLARED  # cnmon cannot tell
    assert mlu.get("custom_attributes")["magicmind_opt_level"] == "O3"
    assert mlu.get("topology_distance") == [20, 0]


def test_nvidia_device(inventory: Inventory) -> None:
    gpu = inventory.get("nvidia:0")
    assert gpu is not None
    assert gpu.name == "Tesla T4" and gpu.torch_device_type == "cuda"
    assert gpu.get("memory_total_mb") == 15360
    assert gpu.get("supported_dtypes") == ["fp32", "fp16", "int8"]
    assert gpu.fields["p2p_enabled"].provenance is Provenance.VALIDATED
    assert gpu.get("custom_attributes") == {"cuda_graphs": True}
