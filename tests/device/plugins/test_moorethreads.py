"""Moore Threads plugin: ``mthreads-gmi -q`` (written from the vendor's guide) and topo -m."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from mangling import assert_survives, replay_case
from test_smi_topology import topo_text

from kunlun.device.plugin import Health
from kunlun.device.plugins.moorethreads import MooreThreadsPlugin, parse_gmi_query
from kunlun.device.registry import run_plugin
from kunlun.device.tools import ToolRunner
from kunlun.errors import ToolError

FIXTURES = Path(__file__).parents[2] / "fixtures" / "nodes"
S5000 = json.loads((FIXTURES / "topology_output_mthreads_s5000.json").read_text())[0]
BUSES = ["1a", "1b", "3d", "3e", "9c", "9d", "bd", "be"]


def gmi_block(index: int) -> str:
    used = 2 if index != 5 else 61440
    return f"""GPU 00000000:{BUSES[index].upper()}:00.0
    Index                              : {index}
    GPU UUID                           : 4dac4a5e-1b2c-4d3e-8f90-a1b2c3d4e5{index:02d}
    Product Name                       : MTT S5000
    Product Brand                      : MTT
    Product Architecture               : PINGHU
    MTBios Version                     : 4.1.0
    PCI
        Bus                            : 0x{BUSES[index]}
        Bus Id                         : 00000000:{BUSES[index]}:00.0
    Memory Usage
        Total                          : 81920MiB
        Used                           : {used}MiB
        Free                           : {81920 - used}MiB
    Utilization
        Gpu                            : {88 if index == 5 else 0}%
        Memory                         : 0%
    Temperature
        Gpu                            : {40 + index}C
    Power Readings
        Power Draw                     : {95.5 + index:.2f}W
"""


QUERY = (
    "==============MTHREADS GMI LOG==============\n"
    "Timestamp                          : Mon Mar 23 10:00:00 2026\n"
    "Driver Version                     : 3.0.1\n"
    "Attached GPUs                      : 8\n" + "".join(gmi_block(i) for i in range(8))
)
TOPO = topo_text(S5000["devices_distances"], S5000["devices_numa_affinities"], nics=0)
SAMPLES = {"mthreads-gmi -q": QUERY, "mthreads-gmi topo -m": TOPO}


def test_replay_recovers_the_s5000_node(make_replay: Any) -> None:
    found = MooreThreadsPlugin().discover(ToolRunner(replay_dir=make_replay(SAMPLES)))
    assert [d.id for d in found.devices] == [f"moorethreads:{i}" for i in range(8)]
    assert {d.name for d in found.devices} == {"MTT S5000"}
    busy = found.devices[5]
    assert (busy.memory_total_mb, busy.memory_used_mb, busy.utilization_pct) == (81920, 61440, 88)
    assert (busy.temperature_c, busy.power_w, busy.bus_id) == (45.0, 100.5, "0000:9d:00.0")
    assert busy.attributes["driver_version"] == "3.0.1"
    assert busy.supported_dtypes is not None and "fp8_e4m3" in busy.supported_dtypes
    assert [d.topology for d in found.devices] == S5000["devices_distances"]
    assert not any(d.p2p_capable for d in found.devices)  # NODE and SYS only: no P2P path
    assert [d.attributes["numa_node"] for d in found.devices] == S5000["devices_numa_affinities"]
    assert all(d.problems == [] and d.health is Health.UNKNOWN for d in found.devices)


def test_fake_tool_on_path(fake_tools: Any) -> None:
    fake_tools.add("mthreads-gmi", {"-q": QUERY, "topo -m": TOPO})
    report = run_plugin(MooreThreadsPlugin())
    assert report.error is None and len(report.devices) == 8
    assert report.devices[7].topology == S5000["devices_distances"][7]


def test_index_field_orders_devices_and_bad_values_are_problems() -> None:
    text = gmi_block(1) + gmi_block(0).replace("81920MiB", "eighty GiB", 1)
    first, second = parse_gmi_query(text)
    assert (first.index, second.index) == (0, 1)
    assert first.memory_total_mb is None and any("eighty" in p for p in first.problems)
    broken = gmi_block(2).replace("Index                              : 2", "Index : two")
    (device,) = parse_gmi_query(broken)
    assert device.index == 0 and any("'two'" in p for p in device.problems)


def test_garbage_and_failures(fake_tools: Any) -> None:
    with pytest.raises(ToolError, match="no 'GPU <bus id>' blocks"):
        parse_gmi_query("Failed to initialize MTML: Driver Not Loaded\n")
    fake_tools.add("mthreads-gmi", fake_tools.Output(exit_code=1, stderr="Driver Not Loaded"))
    report = run_plugin(MooreThreadsPlugin())
    assert report.error is not None and "Driver Not Loaded" in report.error


@settings(max_examples=50, deadline=None)
@given(replay_case(SAMPLES))
def test_mangled_output_gives_devices_or_tool_error(files: dict[str, str]) -> None:
    assert_survives(MooreThreadsPlugin(), files)
