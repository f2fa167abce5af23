"""Iluvatar plugin: ``ixsmi --query-gpu`` CSV (with and without units) and topo -m."""

from __future__ import annotations

from typing import Any

from hypothesis import given, settings
from mangling import assert_survives, replay_case
from test_smi_topology import topo_text

from kunlun.device.plugins import iluvatar
from kunlun.device.plugins.iluvatar import IluvatarPlugin
from kunlun.device.plugins.nvidia import query_argv
from kunlun.device.registry import run_plugin
from kunlun.device.tools import ToolRunner

QUERY = " ".join(query_argv("ixsmi", iluvatar.QUERY_FIELDS))
CSV = (
    "0, Iluvatar BI-V150, 00000000:13:00.0, GPU-1c2d3e4f-0000-0000-0000-000000000000, 65536, 116, 0, 30, 51.0\n"
    "1, Iluvatar BI-V150, 00000000:14:00.0, GPU-1c2d3e4f-0000-0000-0000-000000000001, 65536, 40960, 93, 47, 240.5\n"
)
# ixsmi versions that ignore ``nounits`` (the form GPUStack's ixsmi detector reads)
CSV_WITH_UNITS = (
    "0, Iluvatar MR-V100, 00000000:3B:00.0, GPU-a, 32768 MiB, 27996 MiB, 0 %, 36 C, [N/A]\n"
)
TOPO = topo_text([[0, 10], [10, 0]], ["0", "0"], nics=0)
SAMPLES = {QUERY: CSV, "ixsmi topo -m": TOPO}


def test_replay(make_replay: Any) -> None:
    found = IluvatarPlugin().discover(ToolRunner(replay_dir=make_replay(SAMPLES)))
    second = found.devices[1]
    assert second.name == "Iluvatar BI-V150" and second.bus_id == "0000:14:00.0"
    assert (second.memory_total_mb, second.memory_used_mb, second.utilization_pct) == (
        65536,
        40960,
        93,
    )
    assert second.supported_dtypes == ["fp32", "bf16", "fp16", "int8"]
    assert [d.topology for d in found.devices] == [[0, 10], [10, 0]]
    assert all(d.p2p_capable for d in found.devices)  # PIX


def test_fake_tool_with_units(fake_tools: Any) -> None:
    fake_tools.add("ixsmi", {QUERY.removeprefix("ixsmi "): CSV_WITH_UNITS})
    report = run_plugin(IluvatarPlugin())
    (device,) = report.devices
    assert (device.memory_total_mb, device.memory_used_mb) == (32768, 27996)
    assert (device.utilization_pct, device.temperature_c, device.power_w) == (0, 36, None)
    assert device.problems == [] and device.supported_dtypes == ["fp32", "fp16", "int8"]
    assert any("topology unknown" in n for n in report.notes)


def test_unknown_model_has_unknown_dtypes(make_replay: Any) -> None:
    csv = "0, Iluvatar ZK-V999, 00000000:13:00.0, GPU-x, 16384, 0, 0, 30, 20\n"
    found = IluvatarPlugin().discover(ToolRunner(replay_dir=make_replay({QUERY: csv})))
    assert found.devices[0].supported_dtypes is None


def test_failing_tool(fake_tools: Any) -> None:
    fake_tools.add("ixsmi", fake_tools.Output(exit_code=6, stderr="No devices were found"))
    report = run_plugin(IluvatarPlugin())
    assert report.error is not None and "No devices were found" in report.error


@settings(max_examples=50, deadline=None)
@given(replay_case(SAMPLES))
def test_mangled_output_gives_devices_or_tool_error(files: dict[str, str]) -> None:
    assert_survives(IluvatarPlugin(), files)
