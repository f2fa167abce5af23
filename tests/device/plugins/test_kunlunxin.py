"""Kunlunxin plugin: ``xpu-smi -q`` (written from Kunlunxin's xpu-smi guide), fake and replayed."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from mangling import assert_survives, replay_case
from test_smi_topology import topo_text

from kunlun.device.plugin import Health
from kunlun.device.plugins.kunlunxin import KunlunxinPlugin, parse_xpu_query
from kunlun.device.registry import run_plugin
from kunlun.device.tools import ToolRunner
from kunlun.errors import ToolError


def xpu_block(bus: str, minor: int, used: int, util: int, temp: int, power: float) -> str:
    return f"""XPU {bus}
    Product Name                          : P800 OAM
    XPU UUID                              : GPU-9a3f4c10-52d1-5e7a-8b3c-0d1e2f3a4b{minor:02d}
    Serial Number                         : 02K02L2C{minor:04d}
    Minor Number                          : {minor}
    PCI
        Bus                               : 0x{bus[9:11]}
        Bus Id                            : {bus}
    Memory Usage
        Total                             : 98304 MiB
        Used                              : {used} MiB
        Free                              : {98304 - used} MiB
    Utilization
        Xpu                               : {util} %
        Memory                            : 0 %
    Temperature
        XPU Current Temp                  : {temp} C
    Power Readings
        Power Draw                        : {power:.2f} W
        Power Limit                       : 400.00 W
    Processes                             : None
"""


QUERY = (
    "\n==============XPU-SMI LOG==============\n\n"
    "Timestamp                                 : Mon Mar 23 10:00:00 2026\n"
    "Driver Version                            : 5.0.21.21\n"
    "XPU-RT Version                            : 5.0.21\n"
    "Attached XPUs                             : 4\n"
    + xpu_block("00000000:52:00.0", 0, 0, 0, 40, 85.0)
    + xpu_block("00000000:56:00.0", 1, 30720, 97, 61, 310.5)
    + xpu_block("00000000:CE:00.0", 2, 0, 0, 39, 84.1)
    + xpu_block("00000000:D2:00.0", 3, 0, 0, 41, 86.0)
)
# Two pairs behind PCIe switches, the pairs on different NUMA nodes.
TOPO = topo_text(
    [[0, 20, 50, 50], [20, 0, 50, 50], [50, 50, 0, 20], [50, 50, 20, 0]],
    ["0", "0", "1", "1"],
    prefix="XPU",
    nics=0,
)
SAMPLES = {"xpu-smi -q": QUERY, "xpu-smi topo -m": TOPO}


def test_replay(make_replay: Any) -> None:
    found = KunlunxinPlugin().discover(ToolRunner(replay_dir=make_replay(SAMPLES)))
    assert [d.id for d in found.devices] == [f"kunlunxin:{i}" for i in range(4)]
    busy = found.devices[1]
    assert busy.name == "P800 OAM" and busy.bus_id == "0000:56:00.0"
    assert (busy.memory_total_mb, busy.memory_used_mb, busy.utilization_pct) == (98304, 30720, 97)
    assert (busy.temperature_c, busy.power_w) == (61.0, 310.5)
    assert busy.uuid == "GPU-9a3f4c10-52d1-5e7a-8b3c-0d1e2f3a4b01"
    assert busy.attributes["driver_version"] == "5.0.21.21"
    assert busy.attributes["minor_number"] == "1"
    assert busy.supported_dtypes == ["fp32", "bf16", "fp16", "int8"]
    assert busy.health is Health.UNKNOWN and busy.problems == []
    assert [d.topology for d in found.devices][2] == [50, 50, 0, 20]
    assert all(d.p2p_capable for d in found.devices)
    assert found.devices[3].attributes["numa_node"] == "1"


def test_fake_tool_on_path_without_topology(fake_tools: Any) -> None:
    fake_tools.add("xpu-smi", {"-q": QUERY})  # `topo -m` is a usage error here
    report = run_plugin(KunlunxinPlugin())
    assert report.error is None and len(report.devices) == 4
    assert all(d.topology is None and d.p2p_capable is None for d in report.devices)
    assert any("topology unknown" in n and "status 2" in n for n in report.notes)


def test_health_word_when_present() -> None:
    text = QUERY.replace(
        "    Processes", "    Health                                : Critical\n    Processes", 1
    )
    devices = parse_xpu_query(text)
    assert devices[0].health is Health.UNHEALTHY and devices[0].health_detail == "Critical"
    assert devices[1].health is Health.UNKNOWN


def test_missing_memory_is_a_problem_and_garbage_a_tool_error() -> None:
    text = QUERY.replace("        Total                             : 98304 MiB\n", "", 1)
    devices = parse_xpu_query(text)
    assert devices[0].memory_total_mb is None
    assert "xpu-smi gives no memory total" in devices[0].problems
    assert devices[1].problems == []
    with pytest.raises(ToolError, match="no 'XPU <bus id>' blocks"):
        parse_xpu_query("xpu-smi: error while loading shared libraries: libxpuml.so\n")
    assert parse_xpu_query("") == []


def test_failing_and_absent_tool(fake_tools: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    fake_tools.add("xpu-smi", fake_tools.Output(exit_code=3, stderr="XPU driver not loaded"))
    report = run_plugin(KunlunxinPlugin())
    assert report.error is not None and "XPU driver not loaded" in report.error
    monkeypatch.setenv("PATH", "/nonexistent")
    assert run_plugin(KunlunxinPlugin()).tool_found is False


@settings(max_examples=50, deadline=None)
@given(replay_case(SAMPLES))
def test_mangled_output_gives_devices_or_tool_error(files: dict[str, str]) -> None:
    assert_survives(KunlunxinPlugin(), files)
