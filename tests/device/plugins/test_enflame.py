"""Enflame plugin: the ``efsmi`` table (written from Enflame's EFSMI guide)."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from mangling import assert_survives, replay_case

from kunlun.device.plugins.enflame import EnflamePlugin, parse_efsmi
from kunlun.device.registry import run_plugin
from kunlun.device.tools import ToolRunner
from kunlun.errors import ToolError

RULE = "+-----------------------------------------------------------------------------+"
TABLE = (
    "\n".join(
        [
            "-------------------------------------------------------------------------------",
            "--------------------- Enflame System Management Interface ---------------------",
            "--------- Enflame Tech, All Rights Reserved. 2019-2024 Copyright (C) ----------",
            "-------------------------------------------------------------------------------",
            "",
            RULE,
            "| EFSMI: 1.15.0.14        Driver Ver: 1.15.0.14                               |",
            "|-----------------------------------------------------------------------------|",
            "|-----------------------------------------------------------------------------|",
            "| DEV    NAME                | FW VER          | BUS-ID      ECC              |",
            "| TEMP   Dpm   Pwr(Usage/Cap)| Mem     GCU Virt| DUsed       SN               |",
            "|-----------------------------------------------------------------------------|",
            "| 0      Enflame T20         | 26.5.3          | 00:2e:00.0  Enable           |",
            "| 34C    Sleep    31W  300W  | 32GiB   Disable | 0.0%        A0610520309003   |",
            RULE,
            "| 1      Enflame T20         | 26.5.3          | 00:2f:00.0  Enable           |",
            "| 52C    Active  211W  300W  | 32GiB   Disable | 87.5%       A0610520309004   |",
            RULE,
        ]
    )
    + "\n"
)
SAMPLES = {"efsmi": TABLE}


def test_replay(make_replay: Any) -> None:
    found = EnflamePlugin().discover(ToolRunner(replay_dir=make_replay(SAMPLES)))
    assert [d.id for d in found.devices] == ["enflame:0", "enflame:1"]
    busy = found.devices[1]
    assert busy.name == "Enflame T20" and busy.bus_id == "00:2f:00.0"
    assert (busy.memory_total_mb, busy.memory_used_mb) == (32768, None)
    assert (busy.temperature_c, busy.power_w, busy.utilization_pct) == (52, 211, 87.5)
    assert busy.attributes == {"driver_version": "1.15.0.14", "firmware": "26.5.3"}
    assert busy.supported_dtypes == ["fp32", "bf16", "fp16", "int8"]
    assert busy.p2p_capable is None and busy.problems == []
    assert any("p2p unknown" in n for n in found.notes)


def test_fake_tool_on_path(fake_tools: Any) -> None:
    fake_tools.add("efsmi", {"": TABLE})
    report = run_plugin(EnflamePlugin())
    assert report.error is None
    assert [d.memory_total_mb for d in report.devices] == [32768, 32768]


def test_odd_rows_and_garbage() -> None:
    odd = TABLE.replace("| 32GiB   Disable | 87.5%", "| ??      Disable | 87.5%")
    devices = parse_efsmi(odd)
    assert devices[0].problems == []
    assert devices[1].memory_total_mb is None and any("??" in p for p in devices[1].problems)
    with pytest.raises(ToolError, match="no GCU rows"):
        parse_efsmi("efsmi: Init EFML failed\n")
    assert parse_efsmi("   \n") == []


def test_failing_tool(fake_tools: Any) -> None:
    fake_tools.add("efsmi", fake_tools.Output(exit_code=4, stderr="Init EFML failed"))
    report = run_plugin(EnflamePlugin())
    assert report.error is not None and "Init EFML failed" in report.error


@settings(max_examples=50, deadline=None)
@given(replay_case(SAMPLES))
def test_mangled_output_gives_devices_or_tool_error(files: dict[str, str]) -> None:
    assert_survives(EnflamePlugin(), files)
