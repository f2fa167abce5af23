"""Cambricon plugin: ``cnmon info`` and the ``cnmon`` list view, replayed and as fake tools."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from mangling import assert_survives, replay_case

from kunlun.device.plugin import Health
from kunlun.device.plugins.cambricon import CambriconPlugin, parse_cnmon_info
from kunlun.device.registry import run_plugin
from kunlun.device.tools import ToolRunner
from kunlun.errors import ToolError

MIXED = Path(__file__).parents[3] / "examples" / "nodes" / "mixed"
INFO = (MIXED / "cnmon_info.txt").read_text()
LIST = (MIXED / "cnmon.txt").read_text()
SAMPLES = {"cnmon info": INFO, "cnmon": LIST}


def test_replay_of_the_mixed_node() -> None:
    found = CambriconPlugin().discover(ToolRunner(replay_dir=MIXED))
    assert [d.id for d in found.devices] == ["cambricon:0", "cambricon:1"]
    first, second = found.devices
    assert first.name == "MLU370-X4" and first.memory_total_mb == 24576
    assert first.memory_used_mb == 1188 and second.utilization_pct == 2.0
    assert (first.temperature_c, first.power_w) == (37.0, 36.0)
    assert [d.bus_id for d in found.devices] == ["0000:3b:00.0", "0000:5e:00.0"]
    assert first.uuid == "MLU-2000A40B-1916-0000-0000-000000000000"
    assert first.attributes["driver_version"] == "v5.10.22"
    assert first.health is Health.OK and first.problems == []
    assert first.supported_dtypes == ["fp32", "bf16", "fp16", "int8", "int4"]
    assert first.p2p_capable is None and first.topology is None
    assert any("p2p unknown" in n for n in found.notes)


def test_fake_cnmon_on_path(fake_tools: Any) -> None:
    fake_tools.add("cnmon", {"info": INFO, "": LIST})
    report = run_plugin(CambriconPlugin())
    assert report.error is None
    assert [(d.name, d.memory_total_mb) for d in report.devices] == [("MLU370-X4", 24576)] * 2
    assert [c.command for c in report.commands] == ["cnmon info", "cnmon"]


def test_mlu_smi_is_accepted_as_alias(fake_tools: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    fake_tools.add("mlu-smi", {"info": INFO, "": LIST})
    monkeypatch.setenv("PATH", f"{fake_tools.bin_dir}:/usr/bin:/bin")
    report = run_plugin(CambriconPlugin())
    assert len(report.devices) == 2
    assert [c.command for c in report.commands] == ["mlu-smi info", "mlu-smi"]


def test_ecc_errors_make_a_warning(make_replay: Any) -> None:
    bad = LIST.replace("| 2%                  0 |", "| 2%                  3 |")
    found = CambriconPlugin().discover(
        ToolRunner(replay_dir=make_replay({**SAMPLES, "cnmon": bad}))
    )
    assert found.devices[0].health is Health.OK
    assert found.devices[1].health is Health.WARNING
    assert found.devices[1].health_detail == "Ecc-Error 3"


def test_list_view_stands_in_when_info_fails(fake_tools: Any) -> None:
    fake_tools.add(
        "cnmon", {"info": fake_tools.Output(exit_code=1, stderr="cndev init failed"), "": LIST}
    )
    report = run_plugin(CambriconPlugin())
    assert report.error is None
    assert [(d.name, d.memory_total_mb, d.memory_used_mb) for d in report.devices] == [
        ("MLU370-X4", 24576, 1188)
    ] * 2
    assert report.devices[1].bus_id == "0000:5e:00.0"
    assert any("cndev init failed" in n for n in report.notes)


def test_both_views_failing_is_a_tool_error(fake_tools: Any) -> None:
    fake_tools.add("cnmon", fake_tools.Output(exit_code=255, stderr="no MLU device found"))
    report = run_plugin(CambriconPlugin())
    assert report.devices == [] and report.error is not None
    assert "status 255" in report.error and "cnmon info" in report.error


def test_garbage_is_a_tool_error_and_odd_values_are_problems(make_replay: Any) -> None:
    with pytest.raises(ToolError, match="no 'Card N' blocks"):
        parse_cnmon_info("Segmentation fault\n")
    odd = INFO.replace("Total                  : 24576 MiB", "Total                  : lots", 1)
    replay = make_replay({**SAMPLES, "cnmon info": odd})
    device = CambriconPlugin().discover(ToolRunner(replay_dir=replay)).devices[0]
    assert device.memory_total_mb is None
    assert any("memory_total_mb" in p and "lots" in p for p in device.problems)


def test_sizes_in_gib_and_tabs() -> None:
    text = "Card 0\nProduct Name\t: MLU590-H8\nPhysical Memory Usage :\n\tTotal\t: 80 GiB\n"
    (device,) = parse_cnmon_info(text)
    assert device.name == "MLU590-H8" and device.memory_total_mb == 81920
    assert device.supported_dtypes is None  # set by the plugin, not the parser


def test_tool_absent(fake_tools: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", str(fake_tools.bin_dir))
    report = run_plugin(CambriconPlugin())
    assert report.tool_found is False and report.devices == []


@settings(max_examples=50, deadline=None)
@given(replay_case(SAMPLES))
def test_mangled_output_gives_devices_or_tool_error(files: dict[str, str]) -> None:
    assert_survives(CambriconPlugin(), files)
