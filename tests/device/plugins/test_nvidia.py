"""NVIDIA plugin: nvidia-smi CSV query and topo -m (replayed and as fake tools), NVML, hangs."""

from __future__ import annotations

import json
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from hypothesis import given, settings
from mangling import assert_survives, replay_case
from test_smi_topology import topo_text

from kunlun.device import registry
from kunlun.device.plugin import Health
from kunlun.device.plugins import nvidia
from kunlun.device.plugins.nvidia import NvidiaPlugin, dtypes_for_compute_cap
from kunlun.device.registry import discover_all, run_plugin
from kunlun.device.tools import ToolRunner
from kunlun.errors import ToolError

FIXTURES = Path(__file__).parents[2] / "fixtures" / "nodes"
QUERY = " ".join(nvidia.query_argv("nvidia-smi", nvidia.QUERY_FIELDS))
TOPO = "nvidia-smi topo -m"


def fixture(kind: str, name: str) -> Any:
    return json.loads((FIXTURES / f"{kind}_output_{name}.json").read_text())


def query_csv(gpus: list[dict[str, Any]]) -> str:
    """``nvidia-smi --query-gpu`` lines for the fixture's GPUs (domain printed as 8 digits)."""
    lines = []
    for gpu in gpus:
        bus = "0000" + gpu["appendix"]["bdf"].upper()
        values = [
            gpu["index"],
            gpu["name"],
            bus,
            gpu["uuid"],
            gpu["memory"],
            gpu["memory_used"],
            gpu["cores_utilization"],
            gpu["temperature"],
            f"{gpu['power_used']:.2f}",
            gpu["compute_capability"],
        ]
        lines.append(", ".join(str(v) for v in values))
    return "\n".join(lines) + "\n"


def node_outputs(name: str) -> dict[str, str]:
    topology = fixture("topology", name)[0]
    return {
        QUERY: query_csv(fixture("detect", name)),
        TOPO: topo_text(topology["devices_distances"], topology["devices_numa_affinities"]),
    }


@pytest.fixture(autouse=True)
def no_nvml(monkeypatch: pytest.MonkeyPatch) -> None:
    """Tests choose their source; a real pynvml on the test machine must not leak in."""
    monkeypatch.setattr(nvidia, "load_nvml", lambda: None)


@pytest.mark.parametrize("name", ["nvidia_h100", "nvidia_h200"])
def test_replay_recovers_fixture_node(name: str, make_replay: Any) -> None:
    gpus, topology = fixture("detect", name), fixture("topology", name)[0]
    found = NvidiaPlugin().discover(ToolRunner(replay_dir=make_replay(node_outputs(name))))
    assert [d.name for d in found.devices] == [g["name"] for g in gpus]
    assert [d.memory_total_mb for d in found.devices] == [g["memory"] for g in gpus]
    assert [d.memory_used_mb for d in found.devices] == [g["memory_used"] for g in gpus]
    assert [d.bus_id for d in found.devices] == [g["appendix"]["bdf"] for g in gpus]
    assert [d.uuid for d in found.devices] == [g["uuid"] for g in gpus]
    assert [d.topology for d in found.devices] == topology["devices_distances"]
    assert all(d.p2p_capable for d in found.devices)
    numa = [d.attributes["numa_node"] for d in found.devices]
    assert numa == topology["devices_numa_affinities"]
    for device in found.devices:
        assert device.health is Health.OK and device.problems == []
        assert device.attributes["compute_cap"] == "9.0"
        assert {"bf16", "fp8_e4m3", "int8"} <= set(device.supported_dtypes or [])


def test_fake_tool_on_path(fake_tools: Any) -> None:
    outputs = node_outputs("nvidia_h200")
    fake_tools.add(
        "nvidia-smi", {QUERY.removeprefix("nvidia-smi "): outputs[QUERY], "topo -m": outputs[TOPO]}
    )
    report = run_plugin(NvidiaPlugin())
    assert report.error is None and report.tool_found
    assert [d.id for d in report.devices] == [f"nvidia:{i}" for i in range(8)]
    assert report.devices[3].name == "NVIDIA H200"
    assert report.devices[3].memory_total_mb == 143771
    assert report.devices[0].topology == [0, 5, 5, 5, 5, 5, 5, 5]
    assert [c.source for c in report.commands] == ["exec", "exec"]


def test_missing_values_are_none_not_problems(make_replay: Any) -> None:
    csv = (
        "0, NVIDIA GB10, 0000000F:01:00.0, GPU-a, [N/A], [N/A], 0, 45, [Not Supported], 12.1\n"
        "1, Tesla T4, 00000000:3B:00.0, GPU-b, 15360, 0, [N/A], [N/A], [N/A], 7.5\n"
    )
    found = NvidiaPlugin().discover(ToolRunner(replay_dir=make_replay({QUERY: csv})))
    gb10, t4 = found.devices
    assert gb10.memory_total_mb is None and gb10.power_w is None and gb10.problems == []
    assert gb10.bus_id == "000f:01:00.0"
    assert t4.utilization_pct is None and t4.temperature_c is None and t4.problems == []
    assert t4.supported_dtypes == ["fp32", "fp16", "int8"]  # Turing: no bf16, no fp8
    assert t4.topology is None and t4.p2p_capable is None
    assert any("topology unknown" in n and "topo -m" in n for n in found.notes)


def test_lost_gpu_and_garbage_fields(make_replay: Any) -> None:
    csv = (
        "0, Tesla V100-SXM2-16GB, 00000000:06:00.0, GPU-a, [GPU is lost], [GPU is lost], "
        "[GPU is lost], [GPU is lost], [GPU is lost], 7.0\n"
        "1, Tesla V100-SXM2-16GB, 00000000:07:00.0, GPU-b, lots, 12, 3, 40, 50.1, seven\n"
        "2, Tesla V100-SXM2-16GB, 00000000:08:00.0\n"
    )
    lost, odd, short = (
        NvidiaPlugin().discover(ToolRunner(replay_dir=make_replay({QUERY: csv}))).devices
    )
    assert lost.health is Health.UNHEALTHY and lost.health_detail == "GPU is lost"
    assert lost.memory_total_mb is None and lost.problems == []
    assert odd.health is Health.OK and odd.memory_used_mb == 12
    assert any("memory_total_mb" in p and "lots" in p for p in odd.problems)
    assert any("compute_cap" in p for p in odd.problems) and odd.supported_dtypes is None
    assert any("3 fields, expected 10" in p for p in short.problems)


@pytest.mark.parametrize(
    ("cc", "dtypes"),
    [
        ("6.0", ["fp32", "fp16"]),
        ("6.1", ["fp32", "fp16", "int8"]),
        ("7.0", ["fp32", "fp16", "int8"]),
        ("8.0", ["fp32", "bf16", "fp16", "int8"]),
        ("8.9", ["fp32", "bf16", "fp16", "fp8_e4m3", "fp8_e5m2", "int8"]),
        ("10.0", ["fp32", "bf16", "fp16", "fp8_e4m3", "fp8_e5m2", "int8"]),
        ("5.0", ["fp32"]),
        ("[N/A]", None),
    ],
)
def test_dtypes_for_compute_cap(cc: str, dtypes: list[str] | None) -> None:
    assert dtypes_for_compute_cap(cc) == dtypes


def test_garbage_output_is_a_tool_error(make_replay: Any) -> None:
    replay = make_replay({QUERY: "Failed to initialize NVML: Driver/library version mismatch\n"})
    with pytest.raises(ToolError, match="no device rows"):
        NvidiaPlugin().discover(ToolRunner(replay_dir=replay))


def test_failing_tool_is_reported(fake_tools: Any) -> None:
    fake_tools.add("nvidia-smi", fake_tools.Output(exit_code=9, stderr="NVIDIA-SMI has failed"))
    report = run_plugin(NvidiaPlugin())
    assert report.devices == []
    assert report.error is not None and "status 9" in report.error and "has failed" in report.error


def test_tool_absent(fake_tools: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", str(fake_tools.bin_dir))
    report = run_plugin(NvidiaPlugin())
    assert report.tool_found is False and report.error is None and report.devices == []
    assert "nvidia-smi not found" in report.notes


def test_hanging_tool_is_killed_and_others_still_list(fake_tools: Any) -> None:
    fake_tools.add("nvidia-smi", fake_tools.Output(sleep_s=60))
    start = time.monotonic()
    report = run_plugin(NvidiaPlugin(), tool_timeout_s=1, timeout_s=5)
    # The tool sleeps 60 s: returning well before that shows it was killed, not waited for.
    assert time.monotonic() - start < 40
    assert report.error is not None and "timed out after 1s" in report.error
    start = time.monotonic()
    reports = {r.device_type: r for r in discover_all(timeout_s=2)}
    assert time.monotonic() - start < 40
    assert reports["nvidia"].devices == []
    # the tool is capped below the plugin limit, so its own "timed out" message comes through
    assert "timed out after 1.6s" in (reports["nvidia"].error or "")
    assert [d.id for d in reports["cpu"].devices] == ["cpu:0"]
    assert registry.PLUGIN_TIMEOUT_S > 2  # the short limit came from the argument


class FakeNvml:
    """Just enough of pynvml: two A100s on one NVLink, and a third GPU across the system."""

    NVML_TEMPERATURE_GPU = 0
    NVML_P2P_CAPS_INDEX_NVLINK = 2
    NVML_P2P_STATUS_OK = 0

    def __init__(self, fail_init: bool = False) -> None:
        self.fail_init, self.shut = fail_init, False

    def nvmlInit(self) -> None:
        if self.fail_init:
            raise RuntimeError("NVML Shared Library Not Found")

    def nvmlShutdown(self) -> None:
        self.shut = True

    def nvmlDeviceGetCount(self) -> int:
        return 3

    def nvmlDeviceGetHandleByIndex(self, i: int) -> int:
        return i

    def nvmlDeviceGetName(self, h: int) -> bytes:
        return b"NVIDIA A100-SXM4-80GB" if h < 2 else b"Tesla T4"

    def nvmlDeviceGetPciInfo(self, h: int) -> SimpleNamespace:
        return SimpleNamespace(busId=f"00000000:{h + 7:02X}:00.0".encode())

    def nvmlDeviceGetUUID(self, h: int) -> str:
        return f"GPU-{h}"

    def nvmlDeviceGetMemoryInfo(self, h: int) -> SimpleNamespace:
        return SimpleNamespace(total=81920 * 2**20, used=512 * 2**20)

    def nvmlDeviceGetUtilizationRates(self, h: int) -> SimpleNamespace:
        return SimpleNamespace(gpu=7)

    def nvmlDeviceGetTemperature(self, h: int, sensor: int) -> int:
        return 33

    def nvmlDeviceGetPowerUsage(self, h: int) -> int:
        raise RuntimeError("NVML_ERROR_NOT_SUPPORTED")

    def nvmlDeviceGetCudaComputeCapability(self, h: int) -> tuple[int, int]:
        return (8, 0) if h < 2 else (7, 5)

    def nvmlDeviceGetP2PStatus(self, a: int, b: int, caps: int) -> int:
        return 0 if {a, b} == {0, 1} else 4

    def nvmlDeviceGetTopologyCommonAncestor(self, a: int, b: int) -> int:
        return 50


def test_nvml_is_preferred_when_importable(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = FakeNvml()
    monkeypatch.setattr(nvidia, "load_nvml", lambda: fake)
    found = NvidiaPlugin().discover(ToolRunner())
    assert [d.name for d in found.devices] == ["NVIDIA A100-SXM4-80GB"] * 2 + ["Tesla T4"]
    assert found.devices[0].bus_id == "0000:07:00.0" and found.devices[0].memory_total_mb == 81920
    assert found.devices[0].power_w is None  # not supported: unknown, not a failure
    assert [d.topology for d in found.devices] == [[0, 5, 50], [5, 0, 50], [50, 50, 0]]
    assert [d.p2p_capable for d in found.devices] == [True, True, False]
    assert "bf16" not in (found.devices[2].supported_dtypes or [])
    assert fake.shut


def test_nvml_failure_falls_back_to_nvidia_smi(
    monkeypatch: pytest.MonkeyPatch, fake_tools: Any
) -> None:
    monkeypatch.setattr(nvidia, "load_nvml", lambda: FakeNvml(fail_init=True))
    outputs = node_outputs("nvidia_h100")
    fake_tools.add(
        "nvidia-smi", {QUERY.removeprefix("nvidia-smi "): outputs[QUERY], "topo -m": outputs[TOPO]}
    )
    found = NvidiaPlugin().discover(ToolRunner())
    assert len(found.devices) == 8
    assert any("NVML failed" in n and "Shared Library" in n for n in found.notes)


def test_replay_never_uses_nvml(monkeypatch: pytest.MonkeyPatch, make_replay: Any) -> None:
    monkeypatch.setattr(nvidia, "load_nvml", lambda: FakeNvml())
    found = NvidiaPlugin().discover(ToolRunner(replay_dir=make_replay(node_outputs("nvidia_h100"))))
    assert [d.name for d in found.devices] == ["NVIDIA H100 80GB HBM3"] * 8


@settings(max_examples=50, deadline=None)
@given(replay_case(node_outputs("nvidia_h100")))
def test_mangled_output_gives_devices_or_tool_error(files: dict[str, str]) -> None:
    assert_survives(NvidiaPlugin(), files)
