"""The Hygon plugin: hy-smi first, DTK rocm-smi as fallback, AMD cards left alone, robustness."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st
from plugin_mangling import check_outcome, mangled, write_outputs

from kunlun.device.inventory import build_inventory
from kunlun.device.plugins.hygon import HY_SMI_ARGV, HygonPlugin, hygon_dtypes
from kunlun.device.plugins.rocm import ROCM_SMI_ARGV, parse_smi_lines
from kunlun.device.tools import ToolRunner
from kunlun.errors import ToolError

NODES = Path(__file__).parents[3] / "examples" / "nodes"
HYGON = NODES / "hygon-dcu"
AMD = NODES / "amd-rx7800xt"
SMI = " ".join(ROCM_SMI_ARGV)
HY = " ".join(HY_SMI_ARGV)
DTK_JSON = (
    HYGON
    / "rocm-smi_--showid_--showmeminfo_vram_--showpower_--showserial_--showuse_--showtemp_--showproductname_--showuniqueid_--json.txt"
).read_text()  # noqa: E501
ROCMINFO = (HYGON / "rocminfo.txt").read_text()

# hy-smi's documented text form (DTK 24.04 hy-smi guide): a rocm-smi style log.
HY_SMI_TEXT = """\
============================ System Management Interface =============================
======================================================================================
DCU[0]\t\t: Device ID: 0x6210
DCU[1]\t\t: Device ID: 0x6210
=================================== Temperature ======================================
DCU[0]\t\t: Temperature (Sensor edge) (C): 47.0
DCU[0]\t\t: Temperature (Sensor junction) (C): 49.0
DCU[1]\t\t: Temperature (Sensor edge) (C): 45.0
DCU[1]\t\t: Temperature (Sensor junction) (C): 46.0
================================= Power Consumption ==================================
DCU[0]\t\t: Average Graphics Package Power (W): 124.0
DCU[1]\t\t: Average Graphics Package Power (W): 121.0
================================ % time DCU is busy ==================================
DCU[0]\t\t: DCU use (%): 35
DCU[1]\t\t: DCU use (%): 0
================================== Memory Usage ======================================
DCU[0]\t\t: vram Total Memory (MiB): 65520
DCU[0]\t\t: vram Total Used Memory (MiB): 51766
DCU[1]\t\t: vram Total Memory (MiB): 65520
DCU[1]\t\t: vram Total Used Memory (MiB): 8
================================== Product Info ======================================
DCU[0]\t\t: Card Series: \t\tK100_AI
DCU[0]\t\t: Card Vendor: \t\tChengdu Haiguang IC Design Co., Ltd.
DCU[1]\t\t: Card Series: \t\tK100_AI
DCU[1]\t\t: Card Vendor: \t\tChengdu Haiguang IC Design Co., Ltd.
=================================== Serial Number ====================================
DCU[0]\t\t: Serial Number: TPX0001
DCU[1]\t\t: Serial Number: TPX0002
=================================== Unique ID ========================================
DCU[0]\t\t: Unique ID: 0x7100fa8866904061
DCU[1]\t\t: Unique ID: 0x7100fa8866904062
=================================== End of SMI Log ===================================
"""
HY_TOPO = json.dumps(
    {
        "card0": {"(Topology) Numa Node": "0"},
        "card1": {"(Topology) Numa Node": "0"},
        "system": {
            "(Topology) Weight between DRM devices 0 and 1": "40",
            "(Topology) Hops between DRM devices 0 and 1": "1",
            "(Topology) Link type between DRM devices 0 and 1": "PCIE",
        },
    }
)


def discover(replay: Path, runner: ToolRunner | None = None):
    return HygonPlugin().discover(runner or ToolRunner(replay_dir=replay))


def test_dtk_rocm_smi_replay() -> None:
    found = discover(HYGON)
    (device,) = found.devices
    assert device.id == "hygon:0"
    assert device.name == "K1xx_AI"  # rocminfo's marketing name
    assert device.memory_total_mb == 65520  # vram Total Memory (MiB)
    assert device.memory_used_mb == 2
    assert device.utilization_pct == 0.0  # DCU use (%)
    assert device.temperature_c == 41.0
    assert device.power_w == 80.0
    assert device.uuid == "7100fa8866904061"
    assert device.attributes["card_vendor"] == "Chengdu Haiguang IC Design Co., Ltd."
    assert device.attributes["gfx_target"] == "gfx928"
    assert device.supported_dtypes == ["fp32", "bf16", "fp16", "int8"]
    assert device.topology == [0] and device.p2p_capable is False
    assert device.problems == [] and found.notes == []


def test_amd_cards_are_left_to_the_amd_plugin() -> None:
    found = discover(AMD)
    assert found.devices == []
    assert found.notes == ["1 card(s) left to the amd plugin"]


def test_hy_smi_is_preferred_over_rocm_smi(tmp_path: Path) -> None:
    replay = write_outputs(
        tmp_path,
        {HY: HY_SMI_TEXT, "hy-smi --showtopo --json": HY_TOPO, SMI: DTK_JSON, "rocminfo": ROCMINFO},
    )
    runner = ToolRunner(replay_dir=replay)
    devices = discover(replay, runner).devices
    assert [r.command for r in runner.records] == [HY, "rocminfo", "hy-smi --showtopo --json"]
    assert [d.index for d in devices] == [0, 1]
    assert [d.memory_used_mb for d in devices] == [51766, 8]
    assert [d.utilization_pct for d in devices] == [35.0, 0.0]
    assert [d.power_w for d in devices] == [124.0, 121.0]
    # Card 0's unique id matches rocminfo's agent: its name and gfx target come from there.
    assert devices[0].name == "K1xx_AI" and devices[0].supported_dtypes is not None
    assert devices[1].name == "K100_AI" and devices[1].supported_dtypes is None
    assert [d.topology for d in devices] == [[0, 10], [10, 0]]
    assert [d.p2p_capable for d in devices] == [True, True]


def test_broken_hy_smi_falls_back_to_rocm_smi(tmp_path: Path) -> None:
    replay = write_outputs(tmp_path, {HY: "hy-smi: no DCU found\n", SMI: DTK_JSON})
    found = discover(replay)
    assert [d.memory_total_mb for d in found.devices] == [65520]
    assert found.notes[0].startswith("hy-smi failed, using rocm-smi:")


def test_broken_hy_smi_without_rocm_smi_is_a_tool_error(tmp_path: Path) -> None:
    replay = write_outputs(tmp_path, {HY: "garbage\n"})
    try:
        discover(replay)
    except ToolError as exc:
        assert "'hy-smi --showid" in exc.message
    else:
        raise AssertionError("expected a ToolError")


def test_hcu_labels_and_keys() -> None:
    text = "HCU[3]   : HCU use (%): 12\nHCU[3]   : vram Total Memory (MiB): 98304\n"
    assert parse_smi_lines(text, "hy-smi") == {
        3: {"hcu use (%)": "12", "vram total memory (mib)": "98304"}
    }


def test_hy_smi_lines_ignore_banners() -> None:
    cards = parse_smi_lines(HY_SMI_TEXT, HY)
    assert sorted(cards) == [0, 1]
    assert cards[0]["card series"] == "K100_AI"
    assert cards[1]["unique id"] == "0x7100fa8866904062"


def test_dtypes_by_gfx_target() -> None:
    assert hygon_dtypes("gfx928") == ["fp32", "bf16", "fp16", "int8"]
    assert hygon_dtypes("gfx906") == ["fp32", "fp16"]
    assert hygon_dtypes("gfx1101") is None


def test_neither_tool() -> None:
    with tempfile.TemporaryDirectory() as empty:
        found = discover(Path(empty))
    assert found.tool_found is False and "hy-smi" in found.notes[0]


def test_fake_hy_smi_on_path(fake_tools) -> None:
    fake_tools.add("hy-smi", {" ".join(HY_SMI_ARGV[1:]): HY_SMI_TEXT, "--showtopo --json": HY_TOPO})
    fake_tools.add("rocminfo", fake_tools.Output(exit_code=1, stderr="no agents"))
    found = HygonPlugin().discover(ToolRunner())
    assert [(d.id, d.name, d.memory_total_mb) for d in found.devices] == [
        ("hygon:0", "K100_AI", 65520),
        ("hygon:1", "K100_AI", 65520),
    ]
    assert [d.temperature_c for d in found.devices] == [47.0, 45.0]
    assert "rocminfo unavailable" in found.notes[0]


def test_scenario_inventory() -> None:
    inventory = build_inventory(HYGON / "device-plugin-config.yaml", HYGON)
    assert [(p.id, p.status.value) for p in inventory.profiles] == [("hygon:0", "Ready")]
    profile = inventory.profiles[0]
    assert profile.reasons == []
    assert profile.fields["memory_total_mb"].provenance.value == "validated"
    assert profile.get("gddr6_memory_mb") == 0
    assert inventory.exit_code() == 0


FILES = {HY: HY_SMI_TEXT, "hy-smi --showtopo --json": HY_TOPO, "rocminfo": ROCMINFO}


@settings(max_examples=60, deadline=None)
@given(data=st.data(), target=st.sampled_from(sorted(FILES)))
def test_mangled_hy_smi_output_never_crashes(data: st.DataObject, target: str) -> None:
    outputs: dict[str, bytes | str] = dict(FILES)
    outputs[target] = data.draw(mangled(FILES[target]), label=target)
    with tempfile.TemporaryDirectory() as tmp:
        check_outcome(HygonPlugin(), write_outputs(Path(tmp), outputs), ("hy-smi",))


@settings(max_examples=40, deadline=None)
@given(smi=mangled(DTK_JSON), info=mangled(ROCMINFO))
def test_mangled_dtk_rocm_smi_never_crashes(smi: bytes, info: bytes) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        replay = write_outputs(Path(tmp), {SMI: smi, "rocminfo": info})
        check_outcome(HygonPlugin(), replay, ("rocm-smi",))
