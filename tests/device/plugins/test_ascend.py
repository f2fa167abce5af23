"""The Ascend plugin: npu-smi tables, mapping, health, topology, fake tool, robustness."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from plugin_mangling import check_outcome, mangled, write_outputs

from kunlun.device.inventory import build_inventory
from kunlun.device.plugin import Health
from kunlun.device.plugins.ascend import AscendPlugin, ascend_dtypes, parse_info, parse_mapping
from kunlun.device.plugins.smi_topology import parse_link_matrix
from kunlun.device.profile import Status, from_probe
from kunlun.device.tools import ToolRunner
from kunlun.errors import ToolError

NODES = Path(__file__).parents[3] / "examples" / "nodes"
A910 = NODES / "ascend-910a-8x"
A310 = NODES / "ascend-310"
INFO_910 = (A910 / "npu-smi_info.txt").read_text()
MAP_910 = (A910 / "npu-smi_info_-m.txt").read_text()
TOPO_910 = (A910 / "npu-smi_info_-t_topo.txt").read_text()
INFO_310 = (A310 / "npu-smi_info.txt").read_text()
MAP_310 = (A310 / "npu-smi_info_-m.txt").read_text()
BUS_910 = [
    "0000:C1:00.0",
    "0000:81:00.0",
    "0000:41:00.0",
    "0000:01:00.0",
    "0000:C2:00.0",
    "0000:82:00.0",
    "0000:42:00.0",
    "0000:02:00.0",
]

# A 910B-style table (npu-smi 23.0) whose HBM column reads 0 / 0: memory falls back.
INFO_ZERO_HBM = """\
+------------------------------------------------------------------------------------------------+
| npu-smi 23.0.rc3                 Version: 23.0.rc3                                             |
+---------------------------+---------------+----------------------------------------------------+
| NPU   Name                | Health        | Power(W)    Temp(C)           Hugepages-Usage(page)|
| Chip                      | Bus-Id        | AICore(%)   Memory-Usage(MB)  HBM-Usage(MB)        |
+===========================+===============+====================================================+
| 0     910B3               | {health:<14}| NA          40                0    / 0             |
| 0                         | 0000:C1:00.0  | 7           1500 / 15000      0    / 0             |
+===========================+===============+====================================================+
"""
MAP_ONE = """\
NPU ID                         Chip ID                        Chip Logic ID                  Chip Name
0                              0                              0                              Ascend 910B3
"""


def discover(replay: Path):
    return AscendPlugin().discover(ToolRunner(replay_dir=replay))


def test_910a_replay_gives_eight_devices_with_hbm_and_bus_ids() -> None:
    found = discover(A910)
    devices = found.devices
    assert [d.index for d in devices] == list(range(8))
    assert {d.name for d in devices} == {"Ascend 910A"}
    assert [d.memory_total_mb for d in devices] == [32768] * 8
    assert [d.memory_used_mb for d in devices] == [0] * 8
    assert [d.bus_id for d in devices] == BUS_910
    assert devices[0].power_w == 70.5 and devices[0].temperature_c == 42.0
    assert devices[3].attributes["memory_usage_total_mb"] == "15039"
    assert devices[0].attributes["npu_smi_version"] == "24.1.RC2"
    assert devices[0].supported_dtypes == ["fp32", "fp16", "int8"]  # no bf16 before the 910B
    assert found.notes == []


def test_310_replay_gives_four_devices_of_8192_mb_and_no_mcu() -> None:
    devices = discover(A310).devices
    assert [d.index for d in devices] == [0, 1, 2, 3]  # the Mcu row (logic id '-') is not one
    assert [d.memory_total_mb for d in devices] == [8192] * 4
    assert [d.memory_used_mb for d in devices] == [2703, 2867, 2867, 2867]
    assert [d.bus_id for d in devices] == [
        "0000:89:00.0",
        "0000:8A:00.0",
        "0000:8B:00.0",
        "0000:8C:00.0",
    ]
    assert {d.name for d in devices} == {"Ascend 310"}  # chip name MiniD, model from the table
    assert devices[0].attributes["chip_name"] == "MiniD"
    assert devices[0].attributes["device_id"] == "3"
    assert devices[0].supported_dtypes == ["fp32", "fp16", "int8"]


def test_index_is_the_chip_logic_id(tmp_path: Path) -> None:
    # NPU 0..7 mapped to logic ids in reverse: the device with logic id 0 is NPU 7's chip.
    rows = MAP_910.splitlines()
    swapped = [rows[0]] + [f"{npu:<31}{0:<31}{7 - npu:<31}Ascend 910A" for npu in range(8)]
    replay = write_outputs(
        tmp_path, {"npu-smi info": INFO_910, "npu-smi info -m": "\n".join(swapped) + "\n"}
    )
    devices = discover(replay).devices
    assert [d.index for d in devices] == list(range(8))
    assert [d.bus_id for d in devices] == list(reversed(BUS_910))
    assert devices[0].attributes["npu_id"] == "7"


def test_mapping_rows_parse_and_mcu_is_skipped() -> None:
    chips, notes = parse_mapping(MAP_310)
    assert [(c.npu_id, c.chip_id, c.logic_id, c.chip_name) for c in chips] == [
        (6, 0, 0, "MiniD"),
        (6, 1, 1, "MiniD"),
        (6, 2, 2, "MiniD"),
        (6, 3, 3, "MiniD"),
    ]
    assert notes == []


def test_memory_falls_back_to_memory_usage_when_hbm_is_zero(tmp_path: Path) -> None:
    replay = write_outputs(
        tmp_path,
        {"npu-smi info": INFO_ZERO_HBM.format(health="OK"), "npu-smi info -m": MAP_ONE},
    )
    (device,) = discover(replay).devices
    assert (device.memory_used_mb, device.memory_total_mb) == (1500, 15000)
    assert device.power_w is None  # NA
    assert device.utilization_pct == 7.0
    assert device.name == "Ascend 910B3"
    assert device.supported_dtypes == ["fp32", "bf16", "fp16", "int8"]


@pytest.mark.parametrize(
    ("word", "health", "status"),
    [
        ("OK", Health.OK, Status.READY),
        ("Warning", Health.WARNING, Status.DEGRADED),
        ("Alarm", Health.UNHEALTHY, Status.UNHEALTHY),
        ("Critical", Health.UNHEALTHY, Status.UNHEALTHY),
        ("Abnormal", Health.UNHEALTHY, Status.UNHEALTHY),
    ],
)
def test_health_words(tmp_path: Path, word: str, health: Health, status: Status) -> None:
    replay = write_outputs(
        tmp_path, {"npu-smi info": INFO_ZERO_HBM.format(health=word), "npu-smi info -m": MAP_ONE}
    )
    (device,) = discover(replay).devices
    assert device.health is health
    assert device.health_detail == word
    profile = from_probe(AscendPlugin(), device)
    assert profile.status is status
    if status is not Status.READY:
        assert any(word in reason for reason in profile.reasons)


def test_910a_fixture_warning_devices() -> None:
    devices = discover(A910).devices
    warned = [d.index for d in devices if d.health is Health.WARNING]
    assert warned == [3, 7]
    assert all(d.health is Health.OK for d in devices if d.index not in warned)


@pytest.mark.parametrize(
    ("name", "dtypes"),
    [
        ("Ascend 910A", ["fp32", "fp16", "int8"]),
        ("Ascend 910B2", ["fp32", "bf16", "fp16", "int8"]),
        ("910_9391", ["fp32", "bf16", "fp16", "int8"]),
        ("Ascend 310P3", ["fp32", "fp16", "int8"]),
        ("MiniD", ["fp32", "fp16", "int8"]),
        ("Ascend 610", None),
    ],
)
def test_dtypes_by_chip_family(name: str, dtypes: list[str] | None) -> None:
    assert ascend_dtypes(name) == dtypes


def test_topology_matrix_gives_distances_and_p2p() -> None:
    matrix = parse_link_matrix(TOPO_910, "NPU", "npu-smi info -t topo")
    assert matrix.indices == list(range(8)) and matrix.problems == []
    assert matrix.links[0][1] == "HCCS" and matrix.links[0][4] == "PHB"
    devices = discover(A910).devices
    assert devices[0].topology == [0, 5, 5, 5, 30, 30, 50, 50]
    assert devices[6].topology == [50, 50, 30, 30, 5, 5, 0, 5]
    assert all(d.p2p_capable for d in devices)
    rows = [d.topology for d in devices]
    assert all(rows[i][j] == rows[j][i] for i in range(8) for j in range(8))


def test_pcie_only_topology_has_no_p2p(tmp_path: Path) -> None:
    topo = (
        "       NPU0   NPU1   CPU Affinity\nNPU0   X      SYS    0-23\nNPU1   SYS    X      24-47\n"
    )
    info = INFO_910.split("| 2     xxx")[0]  # the first two NPUs only
    mapping = "\n".join(MAP_910.splitlines()[:3]) + "\n"
    replay = write_outputs(
        tmp_path, {"npu-smi info": info, "npu-smi info -m": mapping, "npu-smi info -t topo": topo}
    )
    devices = discover(replay).devices
    assert [d.topology for d in devices] == [[0, 50], [50, 0]]
    assert [d.p2p_capable for d in devices] == [False, False]


def test_topology_for_other_npus_is_a_note(tmp_path: Path) -> None:
    topo = "       NPU0   NPU1\nNPU0   X      HCCS\nNPU1   HCCS   X\n"
    replay = write_outputs(
        tmp_path,
        {"npu-smi info": INFO_910, "npu-smi info -m": MAP_910, "npu-smi info -t topo": topo},
    )
    found = discover(replay)
    assert all(d.topology is None for d in found.devices)
    assert any("topology unknown" in n for n in found.notes)


def test_na_link_leaves_that_row_unknown(tmp_path: Path) -> None:
    topo = (
        "       NPU0   NPU1   CPU Affinity\nNPU0   X      NA     0-23\nNPU1   NA     X      0-23\n"
    )
    info = INFO_910.split("| 2     xxx")[0]
    mapping = "\n".join(MAP_910.splitlines()[:3]) + "\n"
    replay = write_outputs(
        tmp_path, {"npu-smi info": info, "npu-smi info -m": mapping, "npu-smi info -t topo": topo}
    )
    found = discover(replay)
    assert [d.topology for d in found.devices] == [None, None]
    assert any("unknown link" in n and "NA" in n for n in found.notes)


def test_without_mapping_devices_use_row_order_and_are_degraded(tmp_path: Path) -> None:
    replay = write_outputs(tmp_path, {"npu-smi info": INFO_310})
    devices = discover(replay).devices
    assert [d.index for d in devices] == [0, 1, 2, 3]
    assert all("row order" in d.problems[-1] for d in devices)
    assert from_probe(AscendPlugin(), devices[0]).status is Status.DEGRADED


def test_chip_missing_from_table_is_listed_with_a_problem(tmp_path: Path) -> None:
    info = INFO_910.split("| 7     xxx")[0]  # NPU 7's rows deleted
    replay = write_outputs(tmp_path, {"npu-smi info": info, "npu-smi info -m": MAP_910})
    devices = discover(replay).devices
    assert len(devices) == 8
    assert devices[7].memory_total_mb is None
    assert "no row for NPU 7 chip 0" in devices[7].problems[0]
    assert devices[6].problems == []


def test_process_table_is_not_read_as_devices() -> None:
    table = parse_info(INFO_910)
    assert [(c.npu_id, c.chip_id) for c in table.chips] == [(n, 0) for n in range(8)]


def test_garbage_number_is_a_problem_not_a_crash(tmp_path: Path) -> None:
    info = INFO_310.replace("73             0", "hot            0", 1)
    replay = write_outputs(tmp_path, {"npu-smi info": info, "npu-smi info -m": MAP_310})
    device = discover(replay).devices[0]
    assert device.temperature_c is None
    assert any("Temp(C) is 'hot'" in p for p in device.problems)


def test_both_commands_failing_is_a_tool_error(tmp_path: Path) -> None:
    replay = write_outputs(tmp_path, {"npu-smi info": "driver error\n", "npu-smi info -m": ""})
    with pytest.raises(ToolError, match="'npu-smi info'"):
        discover(replay)


def test_tool_absent() -> None:
    with tempfile.TemporaryDirectory() as empty:
        found = discover(Path(empty))
    assert found.tool_found is False and found.devices == []
    assert "npu-smi" in found.notes[0]


def test_fake_npu_smi_on_path_gives_the_replay_devices(fake_tools) -> None:
    fake_tools.add("npu-smi", {"info": INFO_910, "info -m": MAP_910, "info -t topo": TOPO_910})
    runner = ToolRunner()
    live = AscendPlugin().discover(runner)
    assert live.devices == discover(A910).devices
    assert len(live.devices) == 8
    assert [r.command for r in runner.records] == [
        "npu-smi info",
        "npu-smi info -m",
        "npu-smi info -t topo",
    ]


def test_fake_npu_smi_failing_names_the_command(fake_tools) -> None:
    fake_tools.add(
        "npu-smi", fake_tools.Output(exit_code=8, stderr="dcmi module initialize failed")
    )
    with pytest.raises(ToolError, match="npu-smi info"):
        AscendPlugin().discover(ToolRunner())


@pytest.mark.parametrize(
    ("scenario", "statuses", "exit_code"),
    [
        (
            "ascend-910a-8x",
            ["Ready"] * 3 + ["Degraded"] + ["Ready"] * 3 + ["Degraded"],
            1,
        ),
        ("ascend-310", ["Ready"] * 4, 0),
    ],
)
def test_scenario_inventory(scenario: str, statuses: list[str], exit_code: int) -> None:
    node = NODES / scenario
    inventory = build_inventory(node / "device-plugin-config.yaml", node)
    ascend = [p for p in inventory.profiles if p.device_type == "ascend"]
    assert [p.status.value for p in ascend] == statuses
    assert [p.id for p in inventory.profiles] == [p.id for p in ascend]  # nothing else found
    assert inventory.exit_code() == exit_code
    for profile in ascend:
        if profile.status is Status.DEGRADED:
            assert profile.reasons == ["vendor tool reports health 'Warning'"]
        else:
            assert profile.reasons == []
        assert profile.fields["memory_total_mb"].provenance.value == "validated"


FILES = {"npu-smi info": INFO_910, "npu-smi info -m": MAP_910, "npu-smi info -t topo": TOPO_910}


@settings(max_examples=60, deadline=None)
@given(data=st.data(), target=st.sampled_from(sorted(FILES)))
def test_mangled_output_never_crashes(data: st.DataObject, target: str) -> None:
    outputs: dict[str, bytes | str] = dict(FILES)
    outputs[target] = data.draw(mangled(FILES[target]), label=target)
    with tempfile.TemporaryDirectory() as tmp:
        found = check_outcome(AscendPlugin(), write_outputs(Path(tmp), outputs), ("npu-smi",))
    for device in found.devices if found else []:
        if device.health_detail not in (None, "OK", "Warning"):
            assert device.health is Health.UNHEALTHY


@settings(max_examples=30, deadline=None)
@given(info=mangled(INFO_310), mapping=mangled(MAP_310))
def test_mangled_310_output_never_crashes(info: bytes, mapping: bytes) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        replay = write_outputs(Path(tmp), {"npu-smi info": info, "npu-smi info -m": mapping})
        check_outcome(AscendPlugin(), replay, ("npu-smi",))


def test_table_with_a_missing_column_still_lists_devices(tmp_path: Path) -> None:
    # The Temp(C) sub-column is gone from header and rows: the rest still parses.
    info = INFO_310.replace("Temp(C)", "").replace("73             0", "0")
    info = info.replace("74             0", "0").replace("70            0", "0")
    info = info.replace("65            0", "0")
    replay = write_outputs(tmp_path, {"npu-smi info": info, "npu-smi info -m": MAP_310})
    devices = discover(replay).devices
    assert [d.temperature_c for d in devices] == [None] * 4
    assert [d.power_w for d in devices] == [12.8] * 4
    assert [d.memory_total_mb for d in devices] == [8192] * 4
    assert all(d.problems == [] for d in devices)
