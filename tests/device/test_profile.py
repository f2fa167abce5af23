"""Merging declarations into probed facts: statuses, reasons and provenance."""

from __future__ import annotations

import textwrap

from kunlun.device.declaration import DeclaredDevice, parse_declarations
from kunlun.device.plugin import Health, ProbedDevice
from kunlun.device.plugins.cpu import CpuPlugin
from kunlun.device.profile import Status, from_probe, merge
from kunlun.device.topology import check_matrix

PLUGIN = CpuPlugin()


def declare(body: str) -> DeclaredDevice:
    text = "devices:\n  - device_type: cpu\n    device_id: 0\n" + textwrap.indent(
        textwrap.dedent(body), "    "
    )
    return parse_declarations(text, "node.yaml", ["cpu"], {})[0]


def probed(**kw: object) -> ProbedDevice:
    base: dict[str, object] = dict(
        device_type="cpu",
        index=0,
        name="host",
        memory_total_mb=16384,
        memory_used_mb=100,
        health=Health.OK,
        supported_dtypes=["fp32", "bf16"],
        p2p_capable=False,
    )
    base.update(kw)
    return ProbedDevice(**base)  # type: ignore[arg-type]


def test_probe_only_profile_is_ready_and_probed() -> None:
    profile = from_probe(PLUGIN, probed())
    assert profile.status is Status.READY
    data = profile.to_dict()
    assert data["memory_total_mb"] == 16384
    assert data["provenance"]["memory_total_mb"] == "probed"


def test_declared_memory_above_probed_excludes_with_place_and_values() -> None:
    profile = merge(PLUGIN, probed(), declare("total_memory_mb: 20000\n"))
    assert profile.status is Status.EXCLUDED
    (reason,) = profile.reasons
    assert "node.yaml:4 (total_memory_mb)" in reason
    assert "20000" in reason and "16384" in reason


def test_declared_memory_below_probed_is_validated() -> None:
    profile = merge(PLUGIN, probed(), declare("total_memory_mb: 8192\n"))
    assert profile.status is Status.READY
    assert profile.get("memory_total_mb") == 8192
    assert profile.to_dict()["provenance"]["memory_total_mb"] == "validated"


def test_p2p_declared_but_probe_says_no_degrades() -> None:
    profile = merge(PLUGIN, probed(p2p_capable=False), declare("p2p_enabled: true\n"))
    assert profile.status is Status.DEGRADED
    assert "node.yaml:4 (p2p_enabled)" in profile.reasons[0]
    assert profile.get("p2p_enabled") is False


def test_p2p_unknown_to_probe_stays_declared() -> None:
    profile = merge(PLUGIN, probed(p2p_capable=None), declare("p2p_enabled: true\n"))
    assert profile.status is Status.READY
    assert profile.to_dict()["provenance"]["p2p_enabled"] == "declared"


def test_dtypes_beyond_hardware_are_dropped_and_degrade() -> None:
    profile = merge(PLUGIN, probed(), declare("supported_dtypes: [fp32, bf16, int8]\n"))
    assert profile.status is Status.DEGRADED
    assert profile.supports("bf16") and not profile.supports("int8")
    assert profile.to_dict()["provenance"]["supported_dtypes"] == "validated"


def test_health_words() -> None:
    warn = from_probe(PLUGIN, probed(health=Health.WARNING, health_detail="Warning"))
    bad = from_probe(PLUGIN, probed(health=Health.UNHEALTHY, health_detail="Alarm"))
    assert warn.status is Status.DEGRADED
    assert bad.status is Status.UNHEALTHY and "'Alarm'" in bad.reasons[0]


def test_compute_is_normalized_per_dtype() -> None:
    profile = merge(PLUGIN, probed(), declare("int8_compute_power_tflops: 256\n"))
    compute = profile.get("compute_tflops")
    assert compute["int8"] == 256
    assert compute["fp16"] == 128  # derived: int8 TOPS are twice fp16 TFLOPS
    assert "fp16" in profile.get("compute_tflops_derived")
    assert "int8" not in profile.get("compute_tflops_derived")


def test_custom_attribute_of_wrong_type_degrades() -> None:
    profile = merge(PLUGIN, probed(), declare("custom_attributes: {num_threads: many}\n"))
    assert profile.status is Status.DEGRADED
    assert "num_threads='many'" in profile.reasons[0]


def test_status_only_gets_worse() -> None:
    profile = merge(
        PLUGIN,
        probed(health=Health.UNHEALTHY, health_detail="Alarm"),
        declare("p2p_enabled: true\n"),
    )
    assert profile.status is Status.UNHEALTHY
    assert len(profile.reasons) == 2


def test_topology_matrix_consistent_prefix() -> None:
    good = [[0, 5, 10], [5, 0, 10], [10, 10, 0]]
    assert check_matrix(good).complete
    # The seed's case: rows of 3 entries for 4 cards.
    short = [[0, 16, 32], [16, 0, 16], [32, 16, 0], [32, 32, 16]]
    verdict = check_matrix(short)
    assert verdict.num_consistent == 3 and "3 entries for 4 devices" in (verdict.problem or "")
    asym = [[0, 5], [6, 0]]
    assert check_matrix(asym).num_consistent == 1
    assert "not symmetric" in (check_matrix(asym).problem or "")
    assert check_matrix([[1]]).num_consistent == 0
    assert check_matrix([None, [0]]).num_consistent == 0
