"""The AMD plugin: rocm-smi JSON, rocminfo, topology, Hygon cards left alone, robustness."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from plugin_mangling import check_outcome, mangled, write_outputs

from kunlun.device.inventory import build_inventory
from kunlun.device.plugins.amd import AmdPlugin, amd_dtypes
from kunlun.device.plugins.rocm import (
    ROCM_SMI_ARGV,
    bus_id_from_bdfid,
    parse_rocminfo,
    parse_topology_json,
)
from kunlun.device.profile import Status, from_probe
from kunlun.device.tools import ToolRunner
from kunlun.errors import ToolError

NODES = Path(__file__).parents[3] / "examples" / "nodes"
AMD = NODES / "amd-rx7800xt"
HYGON = NODES / "hygon-dcu"
SMI = " ".join(ROCM_SMI_ARGV)
TOPO = "rocm-smi --showtopo --json"
SMI_TEXT = (
    AMD
    / "rocm-smi_--showid_--showmeminfo_vram_--showpower_--showserial_--showuse_--showtemp_--showproductname_--showuniqueid_--json.txt"
).read_text()  # noqa: E501
ROCMINFO = (AMD / "rocminfo.txt").read_text()
TOPO_ONE = (AMD / "rocm-smi_--showtopo_--json.txt").read_text()


def discover(replay: Path):
    return AmdPlugin().discover(ToolRunner(replay_dir=replay))


def cards(n: int) -> str:
    """The recorded card, ``n`` times, with distinct unique ids."""
    card = json.loads(SMI_TEXT)["card0"]
    out = {}
    for i in range(n):
        out[f"card{i}"] = dict(
            card, **{"Unique ID": f"0x5c88007d7603740{i}", "Node ID": str(i + 1)}
        )
    return json.dumps(out)


def four_gpu_topology() -> str:
    """Cards 0-1 and 2-3 joined by XGMI; PCIe otherwise, 2 and 3 on another NUMA node."""
    system = {}
    for i in range(4):
        for j in range(i + 1, 4):
            xgmi = (i, j) in ((0, 1), (2, 3))
            system[f"(Topology) Weight between DRM devices {i} and {j}"] = "15" if xgmi else "40"
            system[f"(Topology) Hops between DRM devices {i} and {j}"] = "1" if xgmi else "2"
            system[f"(Topology) Link type between DRM devices {i} and {j}"] = (
                "XGMI" if xgmi else "PCIE"
            )
    data: dict[str, object] = {
        f"card{i}": {"(Topology) Numa Node": "0" if i < 2 else "1"} for i in range(4)
    }
    data["system"] = system
    return json.dumps(data)


def test_rx7800xt_replay() -> None:
    found = discover(AMD)
    (device,) = found.devices
    assert device.id == "amd:0"
    assert device.name == "AMD Radeon RX 7800 XT"  # rocminfo's marketing name
    assert device.memory_total_mb == 16368  # 17163091968 B
    assert device.memory_used_mb == 11077
    assert device.utilization_pct == 100.0
    assert device.temperature_c == 45.0  # edge sensor
    assert device.power_w == 53.0
    assert device.bus_id == "0000:03:00.0"  # rocminfo BDFID 768
    assert device.uuid == "0x5c88007d760374f3"
    assert device.attributes["gfx_target"] == "gfx1101"
    assert device.supported_dtypes == ["fp32", "bf16", "fp16", "int8"]
    assert device.topology == [0] and device.p2p_capable is False
    assert device.problems == [] and found.notes == []


def test_hygon_cards_are_left_to_the_hygon_plugin() -> None:
    found = discover(HYGON)
    assert found.devices == []
    assert found.tool_found is True
    assert found.notes == ["1 card(s) left to the hygon plugin"]


def test_without_rocminfo_the_name_is_the_card_series(tmp_path: Path) -> None:
    replay = write_outputs(tmp_path, {SMI: SMI_TEXT, TOPO: TOPO_ONE})
    (device,) = discover(replay).devices
    assert device.name == "Navi 32 [Radeon RX 7700 XT / 7800 XT]"
    assert device.bus_id is None
    assert device.attributes["gfx_target"] == "gfx1101"  # from rocm-smi's "gfx11001"
    assert device.memory_total_mb == 16368


def test_memory_from_rocminfo_when_rocm_smi_has_none(tmp_path: Path) -> None:
    card = json.loads(SMI_TEXT)
    del card["card0"]["VRAM Total Memory (B)"]
    replay = write_outputs(tmp_path, {SMI: json.dumps(card), "rocminfo": ROCMINFO})
    (device,) = discover(replay).devices
    assert device.memory_total_mb == 16368  # 16760832 KB pool
    assert "rocminfo's memory pool" in device.problems[0]
    assert from_probe(AmdPlugin(), device).status is Status.DEGRADED


def test_garbage_number_is_a_problem(tmp_path: Path) -> None:
    replay = write_outputs(tmp_path, {SMI: SMI_TEXT.replace('"100"', '"busy"')})
    (device,) = discover(replay).devices
    assert device.utilization_pct is None
    assert device.problems == ["'" + SMI + "': card0 'gpu use (%)' is 'busy', not a number"]


def test_older_key_spelling_is_read(tmp_path: Path) -> None:
    old = {
        "card0": {
            "Card series": "Instinct MI210",
            "Card vendor": "Advanced Micro Devices, Inc. [AMD/ATI]",
            "GPU use (%)": "3",
            "VRAM Total Memory (B)": "68702699520",
            "VRAM Total Used Memory (B)": "10960896",
            "Temperature (Sensor junction) (C)": "36.0",
            "Current Socket Graphics Package Power (W)": "41.0",
            "PCI Bus": "0000:C1:00.0",
        }
    }
    replay = write_outputs(tmp_path, {SMI: "WARNING: something\n" + json.dumps(old)})
    (device,) = discover(replay).devices
    assert (device.name, device.memory_total_mb, device.memory_used_mb) == (
        "Instinct MI210",
        65520,
        10,
    )
    assert (device.temperature_c, device.power_w, device.bus_id) == (36.0, 41.0, "0000:C1:00.0")


def test_four_gpu_topology_distances_and_p2p(tmp_path: Path) -> None:
    replay = write_outputs(tmp_path, {SMI: cards(4), TOPO: four_gpu_topology()})
    devices = discover(replay).devices
    assert [d.topology for d in devices] == [
        [0, 5, 50, 50],
        [5, 0, 50, 50],
        [50, 50, 0, 5],
        [50, 50, 5, 0],
    ]
    assert all(d.p2p_capable for d in devices)


def test_pcie_hops_give_distance_and_p2p() -> None:
    text = json.dumps(
        {
            "card0": {"(Topology) Numa Node": "0"},
            "card1": {"(Topology) Numa Node": "0"},
            "card2": {"(Topology) Numa Node": "0"},
            "system": {
                "(Topology) Link type between DRM devices 0 and 1": "PCIE",
                "(Topology) Hops between DRM devices 0 and 1": "2",
                "(Topology) Link type between DRM devices 0 and 2": "PCIE",
                "(Topology) Hops between DRM devices 0 and 2": "3",
                "(Topology) Link type between DRM devices 1 and 2": "PCIE",
                "(Topology) Hops between DRM devices 1 and 2": "3",
            },
        }
    )
    rows, p2p = parse_topology_json(text, TOPO, [0, 1, 2])
    assert rows == {0: [0, 20, 30], 1: [20, 0, 30], 2: [30, 30, 0]}
    assert p2p == {0: True, 1: True, 2: False}


def test_incomplete_topology_is_a_note(tmp_path: Path) -> None:
    replay = write_outputs(tmp_path, {SMI: cards(2), TOPO: '{"card0": {}, "card1": {}}'})
    found = discover(replay)
    assert [d.topology for d in found.devices] == [None, None]
    assert "no usable link between card0" in found.notes[0]


def test_rocminfo_agents_and_bus_ids() -> None:
    (agent,) = parse_rocminfo(ROCMINFO)  # the CPU agent is not one
    assert agent["marketing name"] == "AMD Radeon RX 7800 XT"
    assert bus_id_from_bdfid("768") == "0000:03:00.0"
    assert bus_id_from_bdfid("49416") == "0000:c1:01.0"
    assert bus_id_from_bdfid("x") is None


@pytest.mark.parametrize(
    ("gfx", "dtypes"),
    [
        ("gfx942", ["fp32", "bf16", "fp16", "fp8_e4m3", "fp8_e5m2", "int8"]),
        ("gfx90a", ["fp32", "bf16", "fp16", "int8"]),
        ("gfx906", ["fp32", "fp16", "int8"]),
        ("gfx1100", ["fp32", "bf16", "fp16", "int8"]),
        ("gfx1030", ["fp32", "fp16", "int8"]),
        ("gfx803", None),
        (None, None),
    ],
)
def test_dtypes_by_gfx_target(gfx: str | None, dtypes: list[str] | None) -> None:
    assert amd_dtypes(gfx) == dtypes


def test_invalid_json_is_a_tool_error_naming_the_command(tmp_path: Path) -> None:
    replay = write_outputs(tmp_path, {SMI: '{"card0": {'})
    with pytest.raises(ToolError, match="'rocm-smi --showid"):
        discover(replay)


def test_tool_absent() -> None:
    with tempfile.TemporaryDirectory() as empty:
        found = discover(Path(empty))
    assert found.tool_found is False and found.devices == []


def test_fake_rocm_smi_on_path_gives_the_replay_device(fake_tools) -> None:
    fake_tools.add(
        "rocm-smi", {" ".join(ROCM_SMI_ARGV[1:]): SMI_TEXT, "--showtopo --json": TOPO_ONE}
    )
    fake_tools.add("rocminfo", {"": ROCMINFO})
    assert AmdPlugin().discover(ToolRunner()).devices == discover(AMD).devices


def test_fake_rocm_smi_failing_names_the_command(fake_tools) -> None:
    fake_tools.add("rocm-smi", fake_tools.Output(exit_code=1, stderr="amdgpu driver not loaded"))
    fake_tools.add("rocminfo", fake_tools.Output(exit_code=1))
    with pytest.raises(ToolError, match="rocm-smi --showid.*amdgpu driver not loaded"):
        AmdPlugin().discover(ToolRunner())


def test_scenario_inventory() -> None:
    inventory = build_inventory(AMD / "device-plugin-config.yaml", AMD)
    assert [(p.id, p.status.value) for p in inventory.profiles] == [("amd:0", "Ready")]
    assert inventory.profiles[0].reasons == []
    assert inventory.exit_code() == 0


FILES = {SMI: cards(2), "rocminfo": ROCMINFO, TOPO: four_gpu_topology().replace("card2", "x")}


@settings(max_examples=60, deadline=None)
@given(data=st.data(), target=st.sampled_from(sorted(FILES)))
def test_mangled_output_never_crashes(data: st.DataObject, target: str) -> None:
    outputs: dict[str, bytes | str] = dict(FILES)
    outputs[target] = data.draw(mangled(FILES[target]), label=target)
    with tempfile.TemporaryDirectory() as tmp:
        check_outcome(AmdPlugin(), write_outputs(Path(tmp), outputs), ("rocm-smi",))


@settings(max_examples=30, deadline=None)
@given(smi=mangled(SMI_TEXT), info=mangled(ROCMINFO))
def test_mangled_recording_never_crashes(smi: bytes, info: bytes) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        replay = write_outputs(Path(tmp), {SMI: smi, "rocminfo": info, TOPO: TOPO_ONE})
        check_outcome(AmdPlugin(), replay, ("rocm-smi",))
