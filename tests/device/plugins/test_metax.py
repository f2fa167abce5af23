"""MetaX plugin: the ``mx-smi`` table (written from MetaX's guide) and ``mx-smi topo -m``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from mangling import assert_survives, replay_case
from test_smi_topology import topo_text

from kunlun.device.plugins.metax import MetaxPlugin, parse_mx_smi
from kunlun.device.registry import run_plugin
from kunlun.device.tools import ToolRunner
from kunlun.errors import ToolError

FIXTURES = Path(__file__).parents[2] / "fixtures" / "nodes"
C500 = json.loads((FIXTURES / "detect_output_metax_c500.json").read_text())
C500_TOPO = json.loads((FIXTURES / "topology_output_metax_c500.json").read_text())[0]
RULE = "+------------------------------------+---------------------+----------------------+"


def mx_smi_table(gpus: list[dict[str, Any]]) -> str:
    """The ``mx-smi`` table for the fixture's GPUs."""
    lines = [
        "mx-smi  version: 2.1.12",
        "",
        "=================== MetaX System Management Interface Log ===================",
        "Timestamp                                         : Mon Mar 23 10:00:00 2026",
        "",
        "Attached GPUs                                     : 8",
        "+---------------------------------------------------------------------------------+",
        "| MX-SMI 2.1.12                       Kernel Mode Driver Version: 3.6.11           |",
        "| MACA Version: 3.5.3.18              BIOS Version: 1.24.3.0                       |",
        "|------------------------------------+---------------------+----------------------+",
        "| GPU         NAME                   | Bus-id              | GPU-Util             |",
        "| Temp        Pwr:Usage/Cap          | Memory-Usage        |                      |",
        "|====================================+=====================+======================|",
    ]
    for g in gpus:
        lines.append(
            f"| {g['index']:<11} {g['name']:<22} | {g['appendix']['bdf']:<19} | "
            f"{str(g['cores_utilization']) + '%':<20} |"
        )
        power = f"{g['power_used']}W / {g['power']}W"
        memory = f"{g['memory_used']}/{g['memory']} MiB"
        lines.append(f"| {str(g['temperature']) + 'C':<11} {power:<22} | {memory:<19} | {'':<20} |")
        lines.append(RULE)
    lines += [
        "",
        "+---------------------------------------------------------------------------------+",
        "| Process:                                                                        |",
        "|  GPU                    PID         Process Name                 GPU Memory     |",
        "|=================================================================================|",
        "|  0                      41200       python3                      59008 MiB      |",
        "+---------------------------------------------------------------------------------+",
    ]
    return "\n".join(lines) + "\n"


TABLE = mx_smi_table(C500)
TOPO = topo_text(
    C500_TOPO["devices_distances"], C500_TOPO["devices_numa_affinities"], fast="MetaXLink", nics=0
)
SAMPLES = {"mx-smi": TABLE, "mx-smi topo -m": TOPO}


def test_replay_recovers_the_c500_node(make_replay: Any) -> None:
    found = MetaxPlugin().discover(ToolRunner(replay_dir=make_replay(SAMPLES)))
    assert [d.name for d in found.devices] == [g["name"] for g in C500]
    assert [d.memory_total_mb for d in found.devices] == [g["memory"] for g in C500]
    assert [d.memory_used_mb for d in found.devices] == [g["memory_used"] for g in C500]
    assert [d.bus_id for d in found.devices] == [g["appendix"]["bdf"] for g in C500]
    assert [d.temperature_c for d in found.devices] == [g["temperature"] for g in C500]
    assert [d.power_w for d in found.devices] == [g["power_used"] for g in C500]
    assert [d.topology for d in found.devices] == C500_TOPO["devices_distances"]
    assert all(d.p2p_capable for d in found.devices)  # MetaXLink within each group of four
    first = found.devices[0]
    assert first.attributes["driver_version"] == "3.6.11"
    assert first.attributes["maca_version"] == "3.5.3.18"
    assert first.supported_dtypes == ["fp32", "bf16", "fp16", "int8"]
    assert all(d.problems == [] for d in found.devices)


def test_fake_tool_on_path(fake_tools: Any) -> None:
    fake_tools.add("mx-smi", {"": TABLE, "topo -m": TOPO})
    report = run_plugin(MetaxPlugin())
    assert report.error is None and len(report.devices) == 8
    assert report.devices[4].topology == C500_TOPO["devices_distances"][4]


def test_cut_table_and_garbage() -> None:
    cut = TABLE.split("| 36C")[0]  # the first GPU's second line is missing
    (device,) = parse_mx_smi(cut)
    assert device.memory_total_mb is None
    assert any("cut short" in p for p in device.problems)
    with pytest.raises(ToolError, match="no GPU rows"):
        parse_mx_smi("mx-smi: can not open /dev/mxcd\n")


def test_failing_tool(fake_tools: Any) -> None:
    fake_tools.add("mx-smi", fake_tools.Output(exit_code=1, stderr="can not open /dev/mxcd"))
    report = run_plugin(MetaxPlugin())
    assert report.error is not None and "/dev/mxcd" in report.error


@settings(max_examples=50, deadline=None)
@given(replay_case(SAMPLES))
def test_mangled_output_gives_devices_or_tool_error(files: dict[str, str]) -> None:
    assert_survives(MetaxPlugin(), files)
